import pytest
import torch
from transformers import AutoModelForCausalLM

from lisaft.errors import LisaftError
from lisaft.model.load import resolve_attention
from lisaft.model.parts import model_parts

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _configs():
    from transformers import (
        Gemma2Config,
        GemmaConfig,
        GPT2Config,
        GPTNeoXConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    yield "llama", LlamaConfig(**SMALL)
    yield "mistral", MistralConfig(**SMALL)
    yield "qwen2", Qwen2Config(**SMALL)
    yield "qwen3", Qwen3Config(**SMALL, head_dim=8)
    yield "gemma", GemmaConfig(**SMALL, head_dim=8)
    yield "gemma2", Gemma2Config(**SMALL, head_dim=8)
    yield "phi3", Phi3Config(**{k: v for k, v in SMALL.items()}, pad_token_id=0)
    yield "gpt2", GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4, n_positions=64)
    yield "gpt_neox", GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64)


@pytest.mark.parametrize("name, config", list(_configs()), ids=[n for n, _ in _configs()])
def test_layer_discovery_covers_every_parameter_once(name, config):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parts = model_parts(model)
    assert len(parts.layers) == 3
    groups = [p for layer in parts.layers for p in layer.parameters()] + parts.embeddings + parts.head
    ids = [id(p) for p in groups]
    assert len(ids) == len(set(ids)), "a parameter is in two groups"
    assert set(ids) == {id(p) for p in model.parameters()}
    assert any(p is model.get_input_embeddings().weight for p in parts.embeddings)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied or any(p is model.get_output_embeddings().weight for p in parts.head)
    assert parts.head, "final norm belongs to the head"


def test_explicit_layers_path(tiny_llama_config):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_llama_config)
    assert len(model_parts(model, "model.layers").layers) == 4
    with pytest.raises(LisaftError, match="model.layers_path"):
        model_parts(model, "model.norm")


def test_flash_attention_on_cpu_is_a_clear_error():
    with pytest.raises(LisaftError, match="model.attention: flash_attention_2 cannot run"):
        resolve_attention("flash_attention_2", torch.device("cpu"), "bfloat16")
    assert resolve_attention("auto", torch.device("cpu"), "bfloat16") == "sdpa"
    assert resolve_attention("eager", torch.device("cpu"), "float32") == "eager"


def test_unreachable_hub_id_is_one_clear_line(monkeypatch):
    from lisaft.config.schema import ModelSection
    from lisaft.model.load import load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(LisaftError) as e:
        load_model(ModelSection(name_or_path="no-such-org/no-such-model", attention="sdpa"), torch.device("cpu"))
    msg = str(e.value)
    assert msg.startswith("model.name_or_path: 'no-such-org/no-such-model' is not a local folder")
    assert "\n" not in msg
    with pytest.raises(LisaftError, match="no such folder"):
        load_model(ModelSection(name_or_path="./missing/model", attention="sdpa"), torch.device("cpu"))


def test_random_init_from_config_and_local_folder_round_trip(tmp_path, tiny_llama_config):
    from lisaft.config.schema import ModelSection
    from lisaft.model.load import load_model

    tiny_llama_config.save_pretrained(tmp_path / "cfg")
    model = load_model(ModelSection(config=str(tmp_path / "cfg"), tokenizer="t", dtype="bfloat16",
                                    gradient_checkpointing=True, attention="eager"), torch.device("cpu"), seed=3)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    model.save_pretrained(tmp_path / "saved")
    again = load_model(ModelSection(name_or_path=str(tmp_path / "saved"), dtype="bfloat16"), torch.device("cpu"))
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert a.equal(b), n


def _tokenizer_section(**kw):
    from lisaft.config.schema import ModelSection

    return ModelSection(attention="sdpa", **kw)


def test_a_missing_model_folder_blames_name_or_path_not_tokenizer():
    from lisaft.model.load import load_tokenizer

    with pytest.raises(LisaftError, match=r"^model\.name_or_path: \./no-such-model: no such folder$"):
        load_tokenizer(_tokenizer_section(name_or_path="./no-such-model"))


def test_a_folder_without_a_model_says_so(tmp_path, tiny_llama_config):
    from lisaft.model.load import load_model, load_tokenizer

    (tmp_path / "empty").mkdir()
    with pytest.raises(LisaftError, match="model.name_or_path: .*empty: no config.json, so no saved model"):
        load_tokenizer(_tokenizer_section(name_or_path=str(tmp_path / "empty")))
    tiny_llama_config.save_pretrained(tmp_path / "config-only")
    with pytest.raises(LisaftError, match="config-only: no weights .*use model.config instead"):
        load_model(_tokenizer_section(name_or_path=str(tmp_path / "config-only")), torch.device("cpu"))
    with pytest.raises(LisaftError, match="model.tokenizer: .*config-only: no tokenizer in it"):
        folder = str(tmp_path / "config-only")
        load_tokenizer(_tokenizer_section(config=folder, tokenizer=folder))


def test_unreadable_weights_are_a_permission_error(tmp_path, tiny_llama_config):
    from _unprivileged import lisaft_error_as_unprivileged, open_dir
    from transformers import AutoModelForCausalLM

    from lisaft.model.load import load_model

    folder = open_dir(tmp_path) / "m"
    AutoModelForCausalLM.from_config(tiny_llama_config).save_pretrained(folder)
    folder.chmod(0o755)
    (folder / "model.safetensors").chmod(0)
    message = lisaft_error_as_unprivileged(
        lambda: load_model(_tokenizer_section(name_or_path=str(folder)), torch.device("cpu")))
    assert message == f"model.name_or_path: {folder / 'model.safetensors'}: permission denied; make it " \
                      "readable (chmod a+r)"


def test_context_length_error_and_rope_scaling_warning(tiny_llama_config):
    from lisaft.model.load import check_context_length

    check_context_length(tiny_llama_config, 128)
    with pytest.raises(LisaftError, match=r"data.max_seq_len: 129 is above .* \(max_position_embeddings 128\).*"
                                          r"use 128 or less"):
        check_context_length(tiny_llama_config, 129)
    tiny_llama_config.rope_parameters = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    with pytest.warns(UserWarning, match="rope_scaling"):
        check_context_length(tiny_llama_config, 512)


@pytest.mark.parametrize("newer_name", [True, False], ids=["activation_checkpointing", "gradient_checkpointing"])
def test_checkpointing_is_enabled_under_either_transformers_name(monkeypatch, newer_name):
    """transformers 5.17 (the lent GPU machine's) has only gradient_checkpointing_enable; later
    5.x add activation_checkpointing_enable: enable_checkpointing turns it on with either."""
    from transformers import PreTrainedModel

    from lisaft.model.load import enable_checkpointing
    from tests.unit._tiny import tiny

    real = getattr(PreTrainedModel, "activation_checkpointing_enable", None)
    if not newer_name and real is not None:  # as 5.17 has it: the older name, doing the work

        def older(self, gradient_checkpointing_kwargs=None):
            return real(self, activation_checkpointing_kwargs=gradient_checkpointing_kwargs)

        monkeypatch.setattr(PreTrainedModel, "gradient_checkpointing_enable", older)
        monkeypatch.delattr(PreTrainedModel, "activation_checkpointing_enable")
    model = tiny()
    assert hasattr(model, "activation_checkpointing_enable") == (newer_name and real is not None)
    enable_checkpointing(model)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)

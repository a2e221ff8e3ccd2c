"""preference.reference loads as the policy's base: under QLoRA quantized like it (issue 47
item 5), its dtype and attention the policy's, nothing a forward without gradients needs on."""

from lisaft.config.schema import recipe_from_dict
from lisaft.train.preference import reference_section


def test_the_reference_loads_quantized_under_qlora_and_as_the_policy_otherwise():
    base = {"model": {"name_or_path": "policy", "dtype": "bfloat16", "gradient_checkpointing": True},
            "data": {"train": "t.jsonl", "format": "preference"}, "lisa": {"enabled": False},
            "training": {"max_steps": 1, "output_dir": "r"}, "preference": {"loss": "dpo", "reference": "ref"}}
    qlora = recipe_from_dict({**base, "model": {**base["model"], "quantize": "nf4"}, "lora": {"enabled": True}})
    section = reference_section(qlora, "ref")
    assert section.name_or_path == "ref" and section.quantize == "nf4" and section.dtype == "bfloat16"
    assert not section.gradient_checkpointing and not section.offload_activations
    assert reference_section(recipe_from_dict(base), "ref").quantize is None

"""The recipe's `lora` section (LoRA, DoRA; QLoRA with model.quantize: nf4); the combinations it
refuses are rows of config/compat.py's table. Kept beside the schema so schema.py stays one section
per concern.

Defaults are LLaMA-Factory's documented ones (finetuning_args: lora_rank 8, lora_alpha = 2 x
rank, lora_dropout 0, lora_target all linear layers); torchtune's Llama-3 LoRA recipes also use
rank 8, alpha 16, dropout 0. peft's own LoraConfig default (r 8, alpha 8, q_proj/v_proj only for
Llama) learns less per step and is not what the peers ship.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lisaft.config.fields import Bool, Float, Int, Section


class LoraSection(Section):
    enabled: Bool = Field(
        False, description="Train low-rank adapters (peft) on a frozen base instead of the weights "
        "themselves; not with lisa.enabled. Needs the lora extra (pip install 'lisaft[lora]'). "
        "See docs/lora.md.")
    rank: Int = Field(
        8, ge=1, description="r: the adapters' rank (LLaMA-Factory's and torchtune's default).")
    alpha: Float | None = Field(
        None, gt=0, description="Scale alpha; the update is (alpha / rank) x B A. null: 2 x rank "
        "(LLaMA-Factory's default; torchtune's 8B recipe uses 16 at rank 8).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input.")
    target_modules: list[str] | str = Field(
        "all-linear", description="Which linear layers get adapters: all-linear (every linear "
        "layer in the decoder layers, not the output head), or a list of module names such as "
        "[q_proj, v_proj].")
    dora: Bool = Field(
        False, description="DoRA: a learned magnitude per output row on top of the low-rank "
        "direction (peft's use_dora); costs a weight-norm per adapted layer each forward.")
    train_embeddings: Bool = Field(
        False, description="Also train the input embeddings, the output head and the final norm "
        "in full (e.g. for new tokens); off, only the adapters train.")
    export: Literal["merged", "adapter"] = Field(
        "merged", description="What RUN/final holds: merged (the adapters added into the base's weights, "
        "in model.dtype: a plain Hugging Face model; from a 4-bit base, the dequantized NF4 weights plus "
        "the update) or adapter (peft's adapter folder, loaded onto the base with peft).")

    @property
    def scale_alpha(self) -> float:
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank

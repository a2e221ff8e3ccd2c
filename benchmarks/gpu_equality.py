"""CUDA equality checks of the GPU suite: the paths no CPU test executes (cpu_offload's side
stream and pinned staging, activation offload's copies, FlashAttention's varlen kernel, a
compiled layer waiting for the CPU step) against the path they must equal, on a tiny Llama.

  offload-vs-resident   optimizer.cpu_offload against the optimizer on the device, 3 steps of 2
                        micro-batches, float32: the CPU's AdamW is not the GPU's, so to 1e-5
  layer-major           offload_e2e_bench --quick on this device: cpu_offload's layer-major
                        backward (`device`) and `host` against resident, bf16, 4 micro-batches
  activation-offload    model.offload_activations against plain checkpointing: bit for bit
  packed-sdpa / packed-varlen   one train_step over packed rows against the same examples
                        unpacked, loss and gradient norm: with sdpa (float32, 1e-4; per-document
                        position ids) and FlashAttention 2 (bf16, 2e-2; train_step's flatten route,
                        cu_seq_lens), skipped where flash-attn is absent
  compile-offload       training.compile with cpu_offload against eager with cpu_offload (1e-4)
  paged-in-backward     paged AdamW 8-bit stepped in backward (its updates ordered by a CUDA event,
                        not a device sync per parameter) against unpaged AdamW 8-bit stepped after
                        backward, 3 steps: the same kernel on the same chunks, bit for bit

Each check's result goes into --out as soon as it ends. --dry-run: the same checks on CPU (the
compiled layer with dynamo's eager backend, no C++ compiler needed; varlen is skipped without
flash-attn).

    python -m benchmarks.gpu_equality --out benchmarks/results/gpu/equality.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _tiny(device, dtype, seed=0, attention="sdpa", layers=4, hidden=64, vocab=128):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, use_cache=False, attn_implementation=attention)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype)


def _diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def _offload_run(device, offload: bool, compiled: bool, tmp: Path) -> tuple[list[float], dict]:
    """3 steps of 2 micro-batches with clipping, as the trainer's step does them."""
    import torch

    from lisaft.config.schema import LisaSection, OptimizerSection
    from lisaft.lisa import LisaController
    from lisaft.model.parts import model_parts
    from lisaft.model.units import model_units
    from lisaft.optim.cpu_offload import OffloadedOptimizers
    from lisaft.optim.gradients import clip_grad_norm
    from lisaft.optim.unit_optimizers import UnitOptimizers

    model = _tiny(device, torch.float32)
    layers = model_parts(model).layers
    if compiled:
        for layer in layers:
            layer.compile(**({} if device.type == "cuda" else {"backend": "eager"}))
    units = model_units(model_parts(model))
    section = OptimizerSection(name="adamw_32bit", lr=1e-3, weight_decay=0.1, cpu_offload=offload)
    opts = (OffloadedOptimizers if offload else UnitOptimizers)(units, section, device, tmp / f"{offload}{compiled}",
                                                                seed=3)
    if offload:
        opts.step_threads = 2
        opts.wait_in_forward(model, layers)
    ctrl = LisaController(units, opts, LisaSection(enabled=False), seed=3)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for step in range(3):
        ctrl.activate_for_step(step)
        opts.set_lr(1e-3, step)
        total = 0.0
        for m in range(2):
            x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(10 * step + m)).to(device)
            loss = model(input_ids=x, labels=x).loss / 2
            loss.backward()
            total += loss.item()
        losses.append(total)
        if offload:
            opts.clip_and_step(ctrl.trainable_units(), 0.5, measure_norm=True)
        else:
            clip_grad_norm([p for u in units for p in u.params], 0.5)
            opts.step(ctrl.trainable_units())
    if offload:
        opts.wait()
    moved = all(not torch.equal(start[n], p) for n, p in model.named_parameters())
    assert moved, "a parameter did not move: the check would compare nothing"
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def check_offload(device, tmp: Path, compiled_vs_eager: bool = False) -> dict:
    if compiled_vs_eager:
        ref_l, ref_w = _offload_run(device, True, False, tmp)
        got_l, got_w = _offload_run(device, True, True, tmp)
        tol = 1e-4
    else:
        ref_l, ref_w = _offload_run(device, False, False, tmp)
        got_l, got_w = _offload_run(device, True, False, tmp)
        tol = 1e-5
    loss_rel = max(abs(a - b) / abs(a) for a, b in zip(ref_l, got_l))
    weight_diff = max(_diff(ref_w[n], got_w[n]) for n in ref_w)
    return {"ok": loss_rel <= tol and weight_diff <= tol, "tolerance": tol, "loss_max_rel_diff": loss_rel,
            "weight_max_abs_diff": weight_diff}


def check_activation_offload(device, tmp: Path) -> dict:
    import torch

    from lisaft.model.activation_offload import enable_offloaded_checkpoints
    from lisaft.model.load import enable_checkpointing

    results = []
    for offload in (False, True):
        model = _tiny(device, torch.bfloat16, seed=1)
        enable_checkpointing(model)  # transformers 5.17 (the lent machine's) has the older name
        model.train()
        if offload:
            enable_offloaded_checkpoints(model.model.layers, device)
        ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(0)).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    same = bool(torch.equal(l0, l1)) and all(torch.equal(g0[n], g1[n]) for n in g0)
    return {"ok": same, "tolerance": "bit for bit", "grad_max_abs_diff": max(_diff(g0[n], g1[n]) for n in g0)}


def _packed_step(device, attention: str, packing: bool, docs: list[dict], tmp: Path):
    """One train_step of the trainer itself over `docs`, packed into rows or one padded batch:
    with a varlen kernel train_step flattens each micro-batch into one row with cu_seq_lens (its
    `flatten` route), under sdpa it hands over per-document position ids."""
    import torch

    from benchmarks.common import PadOnly
    from lisaft.config.schema import load_recipe
    from lisaft.data.packing import pack_examples
    from lisaft.train import build_session, train_step

    config = tmp / "packed-config.json"
    _tiny("cpu", torch.float32).config.to_json_file(config)
    rows = len(pack_examples(docs, 32, seed=0).rows) if packing else len(docs)
    dtype = "float32" if attention == "sdpa" else "bfloat16"
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [
        "model.name_or_path=null", f"model.config={config}", "model.tokenizer=unused", f"model.dtype={dtype}",
        f"model.attention={attention}", f"data.packing={str(packing).lower()}", "data.max_seq_len=32",
        f"training.batch_size={rows}", "training.max_steps=1", "lisa.enabled=false", f"training.device={device.type}",
        f"training.output_dir={tmp / f'packed-{attention}-{packing}'}"])
    torch.manual_seed(0)
    session = build_session(recipe, tmp / f"packed-{attention}-{packing}", tokenizer=PadOnly(),
                            train_examples=[dict(d) for d in docs], eval_examples=None)
    return train_step(session, 0, measure_norm=True)


def check_packed(device, tmp: Path, attention: str) -> dict:
    """train_step over packed rows against the same examples unpacked: the loss and the gradient
    norm. Without flash-attn (the lent machine has none, and it is too large to carry) the
    varlen check is skipped: what stands is packed-sdpa, the trainer's position-ids route (the
    block-diagonal mask transformers builds from them); train_step's flatten/cu_seq_lens route
    runs only on a flash kernel."""
    import importlib.util

    import numpy as np

    from lisaft.data.collate import IGNORE_INDEX

    if attention == "flash_attention_2" and (device.type != "cuda" or importlib.util.find_spec("flash_attn") is None):
        return {"skipped": "flash-attn not installed or no CUDA device: train_step's flatten/cu_seq_lens route "
                           "did not run; packed-sdpa checked the position-ids route"}
    tol = 1e-4 if attention == "sdpa" else 2e-2
    rng = np.random.default_rng(1)
    docs = []
    for n in (9, 5, 12, 7, 3, 10, 14, 6):
        ids = rng.integers(3, 128, n).tolist()
        docs.append({"input_ids": ids, "labels": [IGNORE_INDEX] * (n // 4) + ids[n // 4:]})
    plain, packed = (_packed_step(device, attention, p, docs, tmp) for p in (False, True))
    loss = abs(plain.loss - packed.loss) / abs(plain.loss)
    norm = abs(plain.grad_norm - packed.grad_norm) / plain.grad_norm
    return {"ok": loss <= tol and norm <= tol and plain.tokens == packed.tokens and packed.padding < plain.padding,
            "tolerance": tol, "route": "flatten (cu_seq_lens)" if attention != "sdpa" else "position ids",
            "loss_rel_diff": loss, "grad_norm_rel_diff": norm, "tokens": [plain.tokens, packed.tokens],
            "padding": [plain.padding, packed.padding]}


def _in_backward_run(device, name: str, in_backward: bool, tmp: Path) -> tuple[list[float], dict, bool]:
    """3 steps of optimizer `name`, updated in backward or after it; matrices of 131,072 elements,
    over the 1e5 from which paged optimizers page their moments."""
    import torch

    from lisaft.config.schema import OptimizerSection
    from lisaft.model.parts import model_parts
    from lisaft.model.units import model_units
    from lisaft.optim.adamw import is_paged
    from lisaft.optim.in_backward import StepInBackward
    from lisaft.optim.unit_optimizers import UnitOptimizers

    model = _tiny(device, torch.float32, layers=2, hidden=256, vocab=512)
    units = model_units(model_parts(model))
    section = OptimizerSection(name=name, lr=1e-3, weight_decay=0.1, in_backward=in_backward)
    opts = UnitOptimizers(units, section, device, tmp / f"{name}{in_backward}", seed=3)
    hooks = StepInBackward(units, opts) if in_backward else None
    losses = []
    for step in range(3):
        opts.set_lr(1e-3, step)
        x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(step)).to(device)
        with hooks.step(measure_norm=False) if hooks else contextlib.nullcontext():
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
        if not hooks:
            opts.step(units)
        losses.append(loss.item())
    paged = any(is_paged(v) for opt in opts.resident.values() for st in opt.state.values() for v in st.values())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, paged


def check_paged_in_backward(device, tmp: Path) -> dict:
    import torch

    ref_l, ref_w, _ = _in_backward_run(device, "adamw_8bit", False, tmp)
    got_l, got_w, paged = _in_backward_run(device, "paged_adamw_8bit", True, tmp)
    same = ref_l == got_l and all(torch.equal(ref_w[n], got_w[n]) for n in ref_w)
    return {"ok": same and (paged or device.type != "cuda"), "tolerance": "bit for bit", "paged_state": paged,
            "weight_max_abs_diff": max(_diff(ref_w[n], got_w[n]) for n in ref_w)}


def check_layer_major(device, tmp: Path) -> dict:
    """`python -m benchmarks.offload_e2e_bench --quick --device cuda`: the trainer's step with
    optimizer.cpu_offload layer-major (`device`) and micro-batch-major (`host`) against the
    resident run, bf16 weights. On CPU `device` equals resident bit for bit; CUDA's backward
    kernels may sum in another order from run to run, so there `device` may differ from resident
    by no more than `host` does, or one bf16 rounding of a weight of 1 (the norms')."""
    from benchmarks.offload_e2e_bench import QUICK, measure

    r = measure(QUICK, QUICK["accum"][0], tmp / "layer-major", device.type)
    same, diff = r["same_weights_bit_for_bit"], r["max_abs_diff"]
    tol = "bit for bit" if device.type != "cuda" else max(diff["host"], 2.0**-7)
    ok = same["device"] or (device.type == "cuda" and diff["device"] <= tol)
    return {"ok": ok, "tolerance": tol, "same_weights_bit_for_bit": same, "weight_max_abs_diff": diff,
            "counts": {arm: {k: v for k, v in r[arm].items() if k.startswith(("offload_", "host_"))}
                       for arm in ("device", "host")}}


CHECKS = {
    "offload-vs-resident": lambda d, t: check_offload(d, t),
    "layer-major": check_layer_major,
    "activation-offload": check_activation_offload,
    "packed-sdpa": lambda d, t: check_packed(d, t, "sdpa"),
    "packed-varlen": lambda d, t: check_packed(d, t, "flash_attention_2"),
    "compile-offload": lambda d, t: check_offload(d, t, compiled_vs_eager=True),
    "paged-in-backward": check_paged_in_backward,
}


def main(argv=None) -> int:
    import tempfile

    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="on CPU")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    results: dict = {"device": str(device), "checks": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, check in CHECKS.items():
            start = time.perf_counter()
            try:
                r = check(device, Path(tmp))
            except Exception as e:  # one failing check must not lose the others' results
                r = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
            r["seconds"] = round(time.perf_counter() - start, 2)
            results["checks"][name] = r
            print(f"{name}: {json.dumps(r)}", flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))
    return 0 if all(r.get("ok", True) for r in results["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

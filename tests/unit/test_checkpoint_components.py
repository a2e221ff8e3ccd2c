"""The checkpoint as components: the one function that lists them (train/session.py
checkpoint_components) is what the checkpointer writes, an optional component resumes a checkpoint
written without it, a missing one is refused by type, and a resumed run links what it did not
change."""

import json

import pytest
import torch

from lisaft.checkpoint.checkpointer import MARKER, Checkpointer
from lisaft.checkpoint.components import STATE_FILE, FolderComponent, OptionalComponent, OwnFile, PerRank, stored
from lisaft.config.schema import recipe_from_dict
from lisaft.errors import OlderCheckpoint
from lisaft.train import build_session, train_step
from lisaft.train.parallel import CpuOffload, SingleProcess
from lisaft.train.session import checkpoint_components


class _PadOnly:
    pad_token_id = 0


def _session(tmp_path, name, tiny_llama_config, **optimizer):
    tiny_llama_config.save_pretrained(tmp_path / "model")
    recipe = recipe_from_dict({
        "model": {"config": str(tmp_path / "model"), "tokenizer": "unused", "dtype": "float32", "attention": "sdpa"},
        "data": {"train": "unused", "max_seq_len": 16},
        "optimizer": {"name": "adamw_32bit", "lr": 1e-3, **optimizer},
        "scheduler": {"name": "cosine", "warmup_steps": 1},
        # One layer at a time, re-sampled every 2 steps: frozen layers to link, moments offloaded.
        "lisa": {"enabled": True, "active_layers": 1, "interval_steps": 2, "state_policy": "offload_cpu"},
        "training": {"seed": 3, "batch_size": 4, "max_steps": 6, "output_dir": str(tmp_path / name),
                     "device": "cpu", "keep_last": 5},
    })
    g = torch.Generator().manual_seed(7)
    rows = torch.randint(3, 64, (32, 16), generator=g).tolist()
    examples = [{"input_ids": r, "labels": list(r)} for r in rows]
    return build_session(recipe, tmp_path / name, tokenizer=_PadOnly(), train_examples=examples, eval_examples=None)


def _train(session, start: int, stop: int) -> None:
    for step in range(start, stop):
        train_step(session, step)
        session.progress.step = step + 1


class Counter:
    """A stateful piece a later version adds."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def _files(name: str, component, ckpt) -> tuple[str, set]:
    """Where a component's kind puts its state, and the checkpoint's files that hold it."""
    s = stored(component)
    inner = s.stored if isinstance(s, OptionalComponent) else s
    if isinstance(inner, OwnFile):
        return "own file", {f"{name}.json"}
    if isinstance(inner, PerRank):
        return "per rank", {f"{name}-rank0.pt"}
    if isinstance(inner.component, FolderComponent):
        return "folder", {str(p.relative_to(ckpt)) for p in (ckpt / name).rglob("*") if p.is_file()}
    return "state", set()


@pytest.mark.parametrize("cpu_offload", [False, True], ids=["device", "cpu_offload"])
def test_the_checkpointer_writes_exactly_the_components_the_one_function_builds(tmp_path, tiny_llama_config,
                                                                              cpu_offload):
    session = _session(tmp_path, "run", tiny_llama_config, cpu_offload=cpu_offload)
    assert isinstance(session.parallel, CpuOffload if cpu_offload else SingleProcess)
    session.controller.activate_for_step(0)
    _train(session, 0, 2)
    ckpt = session.checkpointer().save(2, base=None)
    components = checkpoint_components(session)
    assert list(components)[0] == "weights" and list(components)[-1] == "rng"  # weights first, RNG last
    where = {name: _files(name, c, ckpt) for name, c in components.items()}
    state = json.loads((ckpt / STATE_FILE).read_text())["components"]
    assert set(state) == {n for n, (kind, _) in where.items() if kind == "state"}
    assert set(state) == {"progress", "data", "lisa", "schedule"}
    # Every file is some component's, and every component stored outside state.json has files.
    files = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()}
    assert files == set().union(*(f for _, f in where.values())) | {STATE_FILE, MARKER}
    assert all(f for kind, f in where.values() if kind != "state")
    assert {"recipe.json", "weights/aliases.json", "rng-rank0.pt"} <= files


def test_an_optional_component_resumes_a_checkpoint_written_without_it(tmp_path, tiny_llama_config):
    ref = _session(tmp_path, "ref", tiny_llama_config)
    ref.controller.activate_for_step(0)
    _train(ref, 0, 5)

    cut = _session(tmp_path, "cut", tiny_llama_config)
    cut.controller.activate_for_step(0)
    _train(cut, 0, 3)  # mid interval
    ckpt = cut.checkpointer().save(3, base=None)

    resumed = _session(tmp_path, "cut", tiny_llama_config)
    extra = Counter()
    components = {**checkpoint_components(resumed), "extra": Counter()}
    with pytest.raises(OlderCheckpoint) as refused:
        Checkpointer(resumed.run_dir, 5, components).load(ckpt)
    assert refused.value.component == "extra" and "older lisaft" in str(refused.value)
    assert resumed.progress.step == 0  # refused before anything was loaded

    components = {**checkpoint_components(resumed), "extra": OptionalComponent(extra, default={"n": 7}),
                  "extra_files": OptionalComponent(_Files())}
    Checkpointer(resumed.run_dir, 5, components).load(ckpt)
    assert extra.n == 7 and resumed.progress.step == 3
    _train(resumed, 3, 5)
    for (name, a), b in zip(ref.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


class _Files:
    """A folder component a later version adds."""

    def write(self, folder, base):
        raise AssertionError("not written here")

    def read(self, folder):
        raise AssertionError(f"{folder} does not exist: an optional folder is not read")

    def committed(self):
        pass


def test_a_resumed_run_links_the_units_it_did_not_change(tmp_path, tiny_llama_config):
    first = _session(tmp_path, "run", tiny_llama_config)
    first.controller.activate_for_step(0)
    _train(first, 0, 2)
    ckpt = first.checkpointer().save(2, base=None)

    resumed = _session(tmp_path, "run", tiny_llama_config)
    resumed.checkpointer().load(ckpt)
    _train(resumed, 2, 3)  # interval 1: one layer trains, with the embeddings and the head
    trained = {u.name for u in resumed.controller.trainable_units()}
    nxt = resumed.checkpointer().save(3, base=ckpt)

    def linked(folder: str) -> set:
        old = {f.name: f.stat().st_ino for f in (ckpt / folder).iterdir() if f.suffix in (".safetensors", ".pt")}
        return {f.stem for f in (nxt / folder).iterdir() if old.get(f.name) == f.stat().st_ino}

    units = {u.name for u in resumed.units}
    assert linked("weights") == units - trained
    # Moments: the layer trained in interval 0 sits in host memory, unchanged since it was saved.
    with_state = {f.stem for f in (ckpt / "optimizer").glob("*.pt")}
    assert linked("optimizer") == with_state - trained and linked("optimizer")

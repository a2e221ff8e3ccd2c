"""training.fsdp over torch.distributed: two gloo processes on CPU, each holding half of every unit."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_distributed import assert_same_grad_norms, torchrun, train_losses, weights

from lisaft.metrics.log import read_metrics
from lisaft.model import loss
from lisaft.train import train

COMMON = dict(scheduler={"name": "constant"}, lisa={"interval_steps": 2},
              training={"max_steps": 4, "eval_every": 2, "eval_batches": 3, "save_every": 2})
BF16 = {"model": {"dtype": "bfloat16"}, "optimizer": {"name": "adamw_8bit"}, "lisa": {"state_policy": "offload_cpu"}}
# Twice as wide, so that tensors reach bitsandbytes' 4096 elements and keep 8-bit moments:
# the MLP matrices on each rank's half, the embeddings and head only when whole.
WIDE_BF16 = {**BF16, "model": {**BF16["model"], "config": "wide/config.json"}}
CHUNKED_LOSS_CLI = Path(__file__).with_name("chunked_loss_cli.py")


def recipe(tiny_run, name: str, sections: dict | None = None, **training):
    sections = {k: {**COMMON.get(k, {}), **v} for k, v in (sections or {}).items()}
    return tiny_run(f"{name}.yaml", **{**COMMON, **sections,
                                       "training": {**COMMON["training"], "output_dir": name, **training}})


def fsdp_run(tiny_run, name: str, sections: dict | None = None, compare: bool = True,
             chunk_elements: int | None = None, **training):
    """Two ranks of batch 2 and, for comparison, one process of batch 4. `chunk_elements`: the
    loss's chunk size (loss.LOSS_CHUNK_ELEMENTS) in both, set by chunked_loss_cli.py on the ranks."""
    path = str(recipe(tiny_run, name, sections, batch_size=2, fsdp=True, **training))
    result = (subprocess_torchrun(CHUNKED_LOSS_CLI, chunk_elements, "train", path, cwd=tiny_run.dir)
              if chunk_elements else torchrun("train", path, cwd=tiny_run.dir))
    assert result.returncode == 0, result.stdout + result.stderr
    run, single = tiny_run.dir / name, tiny_run.dir / f"{name}-single"
    out = SimpleNamespace(run=run, single=single, losses=train_losses(run), weights=weights(run))
    if compare:
        with pytest.MonkeyPatch.context() as mp:
            if chunk_elements:
                mp.setattr(loss, "LOSS_CHUNK_ELEMENTS", chunk_elements)
            assert train(recipe(tiny_run, f"{name}-single", sections, batch_size=4, **training), show=False) == 0
        out.single_losses, out.single_weights = train_losses(single), weights(single)
    return out


@pytest.fixture(scope="module")
def lisa(shared_tiny_run):
    return fsdp_run(shared_tiny_run, "lisa")


@pytest.fixture(scope="module")
def bf16(shared_tiny_run):
    cfg = json.loads((shared_tiny_run.dir / "model" / "config.json").read_text())
    (shared_tiny_run.dir / "wide").mkdir(exist_ok=True)
    cfg.update(hidden_size=64, intermediate_size=128)
    (shared_tiny_run.dir / "wide" / "config.json").write_text(json.dumps(cfg))
    return fsdp_run(shared_tiny_run, "bf16", WIDE_BF16)


@pytest.fixture(scope="module")
def full(shared_tiny_run):
    return fsdp_run(shared_tiny_run, "full", {"lisa": {"enabled": False}, "model": {"gradient_checkpointing": True}})


def close_to_one_process(r, rtol=1e-5, wtol=1e-4):
    # Not bit equality: the reduce-scatter sums two partial gradients and clipping sums two
    # partial squared norms, so float32 additions happen in another order.
    assert len(r.losses) == len(r.single_losses) == 4
    assert torch.allclose(torch.tensor(r.losses), torch.tensor(r.single_losses), rtol=rtol, atol=0), \
        (r.losses, r.single_losses)
    assert r.weights.keys() == r.single_weights.keys()
    for k, w in r.single_weights.items():
        assert torch.allclose(r.weights[k].float(), w.float(), rtol=wtol, atol=wtol), k
    assert_same_grad_norms(r.run, r.single, rtol=rtol)


# A rank's packed micro-batch: batch 2 rows of data.max_seq_len 32 positions.
RANK_POSITIONS = 2 * 32
# The loss's chunk, in positions: loss.LOSS_CHUNK_ELEMENTS set to this many rows of logits of the
# tiny vocabulary, so the head and the loss run in chunks of positions, outside the model's own
# forward, the last chunk shorter than the others, on two ranks and in one process
# (lisaft/model/loss.py). At the library's chunk size this took a 600,000-row vocabulary, whose
# embeddings, head and moments made this the suite's slowest fixture (~40 s against ~10 s).
CHUNK_POSITIONS = 27


@pytest.fixture(scope="module")
def chunked_loss(shared_tiny_run):
    vocab = json.loads((shared_tiny_run.dir / "model" / "config.json").read_text())["vocab_size"]
    # No checkpoints: the comparison reads the metrics and RUN/final only.
    out = fsdp_run(shared_tiny_run, "chunked-loss", {"data": {"packing": True}}, chunk_elements=CHUNK_POSITIONS * vocab,
                   save_every=0)
    out.vocab, out.elements = vocab, CHUNK_POSITIONS * vocab
    return out


@pytest.mark.slow
def test_the_chunked_loss_on_two_ranks_matches_one_process(chunked_loss):
    step = chunked_loss.elements // chunked_loss.vocab  # loss.py's positions per chunk
    assert RANK_POSITIONS * chunked_loss.vocab > chunked_loss.elements  # chunked (loss.chunked)
    assert RANK_POSITIONS / step > 2 and RANK_POSITIONS % step  # three chunks, the last one shorter
    close_to_one_process(chunked_loss)


@pytest.mark.slow
def test_lisa_on_two_ranks_matches_one_process_at_twice_the_batch(lisa):
    close_to_one_process(lisa)
    records = [r for r in read_metrics(lisa.run / "metrics.jsonl") if "loss" in r]
    assert [r["active_layers"] for r in records] == [[0, 2], [0, 2], [0, 1], [0, 1]]  # layer 1 joins after a switch
    ckpt = lisa.run / "checkpoints" / "step-000004"
    # torch.distributed.checkpoint: each rank's slices in its own file, and rank 0's metadata.
    assert {p.name for p in (ckpt / "shards").iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert (ckpt / "optimizer" / "rank-1" / "layer-00001.pt").is_file() and not (ckpt / "weights").exists()


@pytest.mark.slow
def test_generate_reads_a_sharded_checkpoint_in_one_process(lisa):
    # DCP joins the two ranks' slices into the whole model without a process group: the step-4
    # checkpoint holds exactly what the export does, and generate gives the same text from both.
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from lisaft.checkpoint.checkpointer import load_weights
    from lisaft.cli import app

    ckpt = lisa.run / "checkpoints" / "step-000004"
    model = AutoModelForCausalLM.from_pretrained(lisa.run / "final")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_weights(ckpt, model)
    state = model.state_dict()
    assert all(state[k].equal(w) for k, w in lisa.weights.items())
    outputs = [CliRunner().invoke(app, ["generate", str(path), "--prompt", "abc", "--max-new-tokens", "5"])
               for path in (ckpt, lisa.run / "final")]
    assert outputs[0].exit_code == 0 and outputs[1].exit_code == 0, outputs[0].output + outputs[1].output
    assert "warning" not in outputs[0].output
    assert outputs[0].output.split("> abc")[1] == outputs[1].output.split("> abc")[1]


@pytest.mark.slow
def test_full_fine_tuning_with_gradient_checkpointing_on_two_ranks_matches_one_process(full):
    # A recomputed layer gathers its weights again in backward.
    close_to_one_process(full)


@pytest.mark.slow
def test_the_export_loads_in_transformers_and_matches_one_process(lisa, shared_tiny_run):
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 9, 2, 11, 7, 3]])
    logits = [AutoModelForCausalLM.from_pretrained(path).eval()(input_ids=ids).logits
              for path in (lisa.run / "final", shared_tiny_run.dir / "lisa-single" / "final")]
    assert torch.allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    # Joined tensor by tensor from the ranks' slices (DCP's Hugging Face writer), with its index.
    final = lisa.run / "final"
    assert (final / "model.safetensors.index.json").is_file() and not (final / "sharded").exists()
    assert json.loads((final / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.slow
def test_bf16_lisa_with_8bit_moments_offloaded_trains_like_one_process(bf16):
    # bf16 weights take stochastically rounded updates whose noise differs per slice, and 8-bit
    # moments are quantized per slice: close to one process, not equal. Layer 1 is frozen at the
    # first forward and trains after the switch (the bf16 unfreeze path FSDP once broke on).
    assert bf16.losses[-1] < bf16.losses[0]
    assert torch.allclose(torch.tensor(bf16.losses), torch.tensor(bf16.single_losses), rtol=2e-2, atol=0)
    assert_same_grad_norms(bf16.run, bf16.single, rtol=2e-2)
    moments = torch.load(bf16.run / "checkpoints" / "step-000004" / "optimizer" / "rank-0" / "layer-00001.pt",
                         weights_only=True)
    assert any(st["exp_avg"].dtype == torch.uint8 for st in moments["state"].values())


def cut_at_step_2(run, name: str):
    """A copy of the run as if it had stopped after its step-2 checkpoint."""
    cut = run.parent / name
    shutil.copytree(run, cut)
    shutil.rmtree(cut / "final")
    shutil.rmtree(cut / "checkpoints" / "step-000004")
    return cut


def resume_on_one_rank(run, name: str, tiny_run):
    """The run's step-2 checkpoint continued by one rank at the same global batch: its losses
    (the first two are the two-rank run's own) and what the resume printed."""
    cut = cut_at_step_2(run, name)
    result = torchrun("resume", str(cut), "--set", "training.batch_size=4", cwd=tiny_run.dir, nproc=1)
    assert result.returncode == 0, result.stdout + result.stderr
    return cut, train_losses(cut), result.stdout + result.stderr


@pytest.mark.slow
def test_a_two_rank_float32_run_resumes_on_one_rank_as_it_would_have_gone_on(lisa, shared_tiny_run):
    # DCP reshards the weights and lisaft/checkpoint/reshard.py the float32 moments, both exactly, so only the
    # order of float32 additions (one rank sums what two summed) separates the two continuations.
    cut, losses, output = resume_on_one_rank(lisa.run, "lisa-to-one", shared_tiny_run)
    assert "on 1 ranks (written by 2)" in output
    assert losses[:2] == lisa.losses[:2]
    assert torch.allclose(torch.tensor(losses), torch.tensor(lisa.losses), rtol=1e-5, atol=0), (losses, lisa.losses)
    resumed = weights(cut)
    for k, w in lisa.weights.items():
        assert torch.allclose(resumed[k].float(), w.float(), rtol=1e-4, atol=1e-4), k


@pytest.mark.slow
def test_bf16_8bit_moments_offloaded_resume_on_one_rank(bf16, shared_tiny_run):
    # On one rank the embeddings cross bitsandbytes' 4096-element line (float32 moments on each
    # half become 8-bit) and the MLP's 8-bit blocks of 256 would straddle the halves' rows of 64:
    # those moments are quantized once more, which the resume says.
    _, losses, output = resume_on_one_rank(bf16.run, "bf16-to-one", shared_tiny_run)
    assert "dequantized and quantized again" in output
    assert losses[:2] == bf16.losses[:2]
    assert torch.allclose(torch.tensor(losses), torch.tensor(bf16.losses), rtol=2e-2, atol=0), (losses, bf16.losses)


@pytest.mark.slow
def test_offload_disk_under_fsdp_trains_as_discard_and_resumes_on_one_rank(lisa, shared_tiny_run):
    # Layer 2 trains in steps 1-2 and never again within 4 steps, so where its moments go at the
    # switch changes nothing: the run equals the discard one bit for bit. Each rank offloads its
    # own slices' moments to its own folder and the checkpoint links them.
    disk = fsdp_run(shared_tiny_run, "disk", {"lisa": {"state_policy": "offload_disk"}}, compare=False)
    assert disk.losses == lisa.losses
    assert all(disk.weights[k].equal(w) for k, w in lisa.weights.items())
    for rank in (0, 1):
        assert (disk.run / "checkpoints" / "step-000004" / "optimizer" / f"rank-{rank}" / "layer-00002.pt").is_file()
    # Resumed on one rank, the offloaded moments of both halves are joined and offloaded again.
    _, losses, _ = resume_on_one_rank(disk.run, "disk-to-one", shared_tiny_run)
    assert torch.allclose(torch.tensor(losses), torch.tensor(lisa.losses), rtol=1e-5, atol=0)


@pytest.mark.slow
def test_keep_under_fsdp_trains_as_discard(lisa, shared_tiny_run):
    keep = fsdp_run(shared_tiny_run, "keep", {"lisa": {"state_policy": "keep"}}, compare=False)
    assert keep.losses == lisa.losses
    assert all(keep.weights[k].equal(w) for k, w in lisa.weights.items())


@pytest.mark.slow
def test_sigkill_while_writing_an_fsdp_checkpoint_leaves_the_run_resumable(bf16, shared_tiny_run):
    # Killed with every rank's slices and moments of step 4 written but not rank 0's completion
    # marker: the worst moment. The resume continues from step 2, bit for bit: bf16 with
    # stochastic rounding, 8-bit moments and offloaded state, so the rounding noise of each slice
    # and every rank's moments must come back exactly. (This also holds what a separate test
    # checked on a copy of the bf16 run cut at step 2: the same torchrun resume from the same
    # step-2 checkpoint, the same assertions, one two-rank launch more.)
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    path = recipe(shared_tiny_run, "killed", WIDE_BF16, batch_size=2, fsdp=True)
    run = shared_tiny_run.dir / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LISAFT_TEST_PAUSE_BEFORE_MARKER": "4:120"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "lisaft", "train", str(path)], cwd=shared_tiny_run.dir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 180
    while not (run / "checkpoints" / "PAUSED").exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)
    # torchrun starts each rank in a session of its own: killing the agent's group alone leaves
    # the ranks running (paused here), which the run folder's lock then rightly reports as live.
    ranks = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    for rank in ranks:
        with contextlib.suppress(psutil.NoSuchProcess):
            rank.kill()
    proc.wait()
    psutil.wait_procs(ranks, timeout=60)
    _wait_for_the_lock(run / ".lock")  # the kernel drops a killed process's lock as it closes its files
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "step-000002" in names and "step-000004" not in names and ".tmp-step-000004" in names
    result = torchrun("resume", str(run), cwd=shared_tiny_run.dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "from step-000002" in result.stdout + result.stderr
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert train_losses(run) == bf16.losses
    resumed = weights(run)
    assert all(resumed[k].equal(bf16.weights[k]) for k in bf16.weights)


def _wait_for_the_lock(path, seconds: float = 60) -> None:
    """Until no process holds the run folder's flock: a SIGKILLed process's lock goes only when
    the kernel has closed its files, which can trail the signal by a moment."""
    import fcntl
    import os
    import time

    deadline = time.time() + seconds
    while True:
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            assert time.time() < deadline, "the killed ranks still hold the run folder's lock"
            time.sleep(0.1)
        finally:
            os.close(fd)


@pytest.mark.slow
def test_a_resume_on_another_number_of_ranks_keeps_the_global_batch(bf16):
    from typer.testing import CliRunner

    from lisaft.cli import app

    out = CliRunner().invoke(app, ["resume", str(bf16.run), "--max-steps", "6"])
    assert out.exit_code == 2 and len(out.output.strip().splitlines()) == 1, out.output
    assert "written by 2 ranks at a global batch of 4" in out.output
    assert "--set training.batch_size=4" in out.output


@pytest.mark.slow
def test_an_fsdp_run_resumed_without_torchrun_is_refused_in_one_line(bf16):
    from typer.testing import CliRunner

    from lisaft.cli import app

    out = CliRunner().invoke(app, ["resume", str(bf16.run), "--max-steps", "6", "--set", "training.batch_size=4"])
    assert out.exit_code == 2 and "torchrun --nproc-per-node" in out.output, out.output
    assert len(out.output.strip().splitlines()) == 1


def test_fsdp_in_one_process_is_refused_in_one_line_and_writes_nothing(tiny_run):
    from typer.testing import CliRunner

    from lisaft.cli import app

    out = CliRunner().invoke(app, ["train", str(tiny_run(training={"fsdp": True, "output_dir": "one"}))])
    assert out.exit_code == 2 and "torchrun --nproc-per-node" in out.output
    assert len(out.output.strip().splitlines()) == 1 and not (tiny_run.dir / "one").exists()


def save_tiny_model(tiny_run, name: str, tie: bool = False):
    """The tiny run's model, randomly initialised and saved with save_pretrained in float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_run.dir / "model")
    config.tie_word_embeddings = tie
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tiny_run.dir / name)
    return tiny_run.dir / name


@pytest.fixture(scope="module")
def saved(shared_tiny_run):
    save_tiny_model(shared_tiny_run, "saved-model")
    # With checkpointing, set up on the meta model before sharding as load_model sets it up.
    return fsdp_run(shared_tiny_run, "saved", {"model": {"config": None, "name_or_path": "saved-model",
                                                         "gradient_checkpointing": True}})


@pytest.mark.slow
def test_a_saved_model_loaded_shard_by_shard_trains_like_one_process(saved):
    # Each rank read its rows from the safetensors into a model built on the meta device; one
    # process loaded the same folder with from_pretrained.
    close_to_one_process(saved)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shard_by_shard_loading_never_holds_the_whole_model_and_equals_from_pretrained(shared_tiny_run, dtype):
    # A tied head, float32 files: in bfloat16 the rows are rounded as from_pretrained rounds them.
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(shared_tiny_run, f"tied-model-{dtype}", tie=True)
    probe = Path(__file__).with_name("fsdp_meta_probe.py")
    out = shared_tiny_run.dir / f"probe-{dtype}"
    result = subprocess_torchrun(probe, folder, dtype, out, cwd=shared_tiny_run.dir)
    assert result.returncode == 0, result.stdout + result.stderr
    ranks = [torch.load(f"{out}-{r}.pt", weights_only=True) for r in (0, 1)]
    whole = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    for r in ranks:
        # Every unit (four layers, then the root) was sharded while still on the meta device.
        assert r["seen_on_meta"] == [True] * 5 and r["tied"]
        # What load_model sets up, set up on the meta model too.
        assert r["settings"] == {"checkpointing": True, "use_cache": False, "training": True, "attention": "sdpa"}
        # The rotary embedding's inverse frequencies, which no checkpoint holds, computed again.
        buffers = dict(whole.named_buffers())
        assert r["buffers"].keys() == buffers.keys()
        assert all(r["buffers"][n].dtype == b.dtype and r["buffers"][n].equal(b) for n, b in buffers.items())
    for name, p in whole.named_parameters():
        halves = [r["local"][name] for r in ranks]
        assert halves[0].shape[0] == halves[1].shape[0] == p.shape[0] // 2, name  # each rank its half
        assert torch.cat(halves).dtype == p.dtype and torch.cat(halves).equal(p.detach()), name


def subprocess_torchrun(script, *args, cwd):
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_shard_by_shard_loading_refuses_a_model_without_safetensors_in_one_line(tiny_run):
    from transformers import AutoConfig

    from lisaft.config.schema import ModelSection
    from lisaft.errors import LisaftError
    from lisaft.model.load import build_on_meta

    folder = tiny_run.dir / "bin-model"
    AutoConfig.from_pretrained(tiny_run.dir / "model").save_pretrained(folder)
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(LisaftError, match="model.name_or_path: .*this model has none") as e:
        build_on_meta(ModelSection(name_or_path=str(folder)), torch.device("cpu"))
    assert "\n" not in str(e.value)


def test_a_module_whose_buffers_cannot_be_computed_again_is_refused_before_loading():
    from torch import nn

    from lisaft.distributed.fsdp import _buffer_sources
    from lisaft.errors import LisaftError

    class Odd(nn.Module):
        def __init__(self, table):
            super().__init__()
            self.register_buffer("table", table, persistent=False)

    model = nn.Sequential(Odd(torch.ones(3, device="meta")))
    with pytest.raises(LisaftError, match=r"model.name_or_path: m: 0 \(Odd\) keeps buffers"):
        _buffer_sources(model, "m")

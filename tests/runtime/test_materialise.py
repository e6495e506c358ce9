"""Models built on the meta device: each rank materialises only its stage (from a checkpoint read
by name, or each module's own init), trains exactly like the unsplit model, and checkpoints move
between plans and the unsplit model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F

from autosplit.errors import ConstraintError, DistributedError
from autosplit.examples import GPT
from autosplit.runtime.checkpoint import load_checkpoint, save_checkpoint
from autosplit.runtime.materialise import StageNames, materialise
from tests.helpers import NO_SEARCH

STEPS = 3
MICRO = 4
LLAMA: dict[str, Any] = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32)


class SmallCNN(nn.Module):
    """Convolutions with BatchNorm: persistent buffers (running statistics, an integer count)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                                  nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)).mean(dim=(2, 3)))


def _build(name: str) -> nn.Module:
    if name == "gpt":
        return GPT(vocab=64, d_model=32, n_layers=4, max_len=16).double()
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**{**LLAMA, "attn_implementation": "eager"})).double()
    return SmallCNN().double()


def _batches(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    if name == "cnn":
        return [(torch.randn(8, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (8,), generator=g))
                for _ in range(STEPS + 1)]
    vocab = 96 if name == "llama" else 64
    return [(torch.randint(0, vocab, (8, 16), generator=g), torch.randint(0, vocab, (8, 16), generator=g)) for _ in range(STEPS + 1)]


def _loss(out, target: torch.Tensor) -> torch.Tensor:
    logits = out["logits"] if isinstance(out, dict) else out
    return F.cross_entropy(logits.flatten(0, -2) if logits.dim() > 2 else logits, target.flatten())


def _reference(name: str, checkpoint_model: nn.Module, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = []
    opt = torch.optim.Adam(checkpoint_model.parameters(), lr=1e-2)
    chunks = MICRO if name == "cnn" else 1  # BatchNorm normalises each micro-batch, in a pipeline as here
    for x, y in _batches(name)[:steps]:
        loss = cast(torch.Tensor, sum(_loss(checkpoint_model(xc), yc) / chunks for xc, yc in zip(x.chunk(chunks), y.chunk(chunks))))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in checkpoint_model.state_dict().items()}


def _write_checkpoints(folder: Path) -> None:
    """The real models' initial weights, in the three formats a stage reads by name."""
    for name in ("gpt", "llama", "cnn"):
        torch.manual_seed(0)
        model = _build(name)
        torch.save(model.state_dict(), folder / f"{name}.pt")
        dcp.save(model.state_dict(), checkpoint_id=folder / f"{name}.dcp", no_dist=True)
        if name == "llama":
            cast(Any, model).save_pretrained(folder / "llama-hf", max_shard_size="60KB")  # sharded, with an index


def _train_case(folder: str, name: str, weights: str, schedule: str, dp: int, *, rank: int, world: int) -> None:
    import autosplit

    with torch.device("meta"):
        model = _build(name)
    batches = _batches(name)
    # the global batch: each copy steps on a batch of the example's rows (here the same one)
    pipe = autosplit.distribute(model, ["cpu"] * world, example_inputs=(torch.cat([batches[0][0]] * dp),), loss_fn=_loss,
                                weights=f"{folder}/{weights}", schedule=schedule, micro_batches=MICRO, data_parallel=dp,
                                **NO_SEARCH)
    assert all(not p.is_meta for p in pipe.parameters()) and all(p.is_meta for p in model.parameters())
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    losses = []
    for x, y in batches[:STEPS]:
        loss = pipe.step(x, target=y)
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else float(loss))
    torch.manual_seed(0)
    expected, state = _reference(name, _build(name), STEPS)
    if pipe.is_last:
        assert losses == pytest.approx(expected, rel=1e-9, abs=1e-12), (name, weights, losses, expected)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in pipe.state_dict().items()}
    for key, value in full.items():
        torch.testing.assert_close(value, state[key], msg=f"{name} from {weights}: {key} after {STEPS} steps")


def test_meta_models_load_their_stage_by_name_and_train_like_the_unsplit_model(gloo, tmp_path):
    pytest.importorskip("transformers")
    _write_checkpoints(tmp_path)
    cases = [("gpt", "gpt.pt", "gpipe", 1), ("gpt", "gpt.dcp", "1f1b", 1), ("llama", "llama-hf", "gpipe", 1), ("cnn", "cnn.dcp", "1f1b", 1)]
    gloo(2).run(_train_case, [(str(tmp_path), *case) for case in cases])


def test_meta_models_train_like_the_unsplit_model_with_data_parallel_replicas(gloo, tmp_path):
    _write_checkpoints(tmp_path)
    gloo(4).run(_train_case, [(str(tmp_path), "gpt", "gpt.pt", "1f1b", 2)])


# -- checkpoints move between plans ---------------------------------------------------------------


def _save_under_two_stages(folder: str, *, rank: int, world: int) -> None:
    import autosplit

    with torch.device("meta"):
        model = _build("gpt")
    batches = _batches("gpt")
    pipe = autosplit.distribute(model, ["cpu"] * 2, example_inputs=(batches[0][0],), loss_fn=_loss, weights=f"{folder}/gpt.pt",
                                micro_batches=4, **NO_SEARCH)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    for x, y in batches[:2]:
        pipe.step(x, target=y)
        opt.step()
        opt.zero_grad()
    pipe.save(f"{folder}/ckpt", optimizer=opt)
    if rank == 0:
        Path(folder, "plan-a.json").write_text(json.dumps(pipe.plan.stage_of))


def _resume(folder: str, stages: int, schedule: str, *, rank: int, world: int) -> None:
    import autosplit

    with torch.device("meta"):
        model = _build("gpt")
    batches = _batches("gpt")
    pipe = autosplit.distribute(model, ["cpu"] * world, example_inputs=(torch.cat([batches[0][0]] * (world // stages)),), loss_fn=_loss,
                                weights=f"{folder}/ckpt",
                                micro_batches=4, schedule=schedule, data_parallel=world // stages, **NO_SEARCH)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    pipe.load(f"{folder}/ckpt", optimizer=opt)
    x, y = batches[2]
    loss = pipe.step(x, target=y)
    opt.step()
    if pipe.is_last and pipe.layout.replica == 0:
        Path(folder, f"resumed-{world}x{stages}.json").write_text(json.dumps(
            {"loss": float(cast(torch.Tensor, loss)), "stage_of": pipe.plan.stage_of}))


def test_a_checkpoint_saved_under_one_plan_resumes_under_others_and_in_the_unsplit_model(gloo, tmp_path):
    _write_checkpoints(tmp_path)
    gloo(2).run(_save_under_two_stages, [(str(tmp_path),)])
    gloo(3).run(_resume, [(str(tmp_path), 3, "1f1b")])
    gloo(4).run(_resume, [(str(tmp_path), 2, "gpipe")])
    torch.manual_seed(0)
    expected, _ = _reference("gpt", _build("gpt"), 3)
    for run in ("3x3", "4x2"):
        resumed = json.loads((tmp_path / f"resumed-{run}.json").read_text())
        assert resumed["loss"] == pytest.approx(expected[2], rel=1e-9), run
    three = json.loads((tmp_path / "resumed-3x3.json").read_text())["stage_of"]
    assert three != json.loads((tmp_path / "plan-a.json").read_text()), "the resumed run is cut elsewhere"
    torch.manual_seed(7)  # other initial weights and optimizer: everything comes from the checkpoint
    unsplit = _build("gpt")
    opt = torch.optim.Adam(unsplit.parameters(), lr=5.0)
    load_checkpoint(tmp_path / "ckpt", unsplit, opt)
    x, y = _batches("gpt")[2]
    assert float(_loss(unsplit(x), y)) == pytest.approx(expected[2], rel=1e-9)
    assert opt.param_groups[0]["lr"] == 1e-2


def test_a_failed_save_leaves_the_last_good_checkpoint_and_no_half_written_folder(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = _build("gpt")
    save_checkpoint(tmp_path / "ckpt", model)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def failing_save(state, *, checkpoint_id, **kwargs):
        Path(checkpoint_id).mkdir(parents=True)
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
        raise OSError("No space left on device")

    monkeypatch.setattr(dcp, "save", failing_save)
    with pytest.raises(DistributedError, match="No space left on device") as e:
        save_checkpoint(tmp_path / "ckpt", model)
    assert "untouched" in str(e.value)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    fresh = _build("gpt")
    load_checkpoint(tmp_path / "ckpt", fresh)
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, good[key], msg=key)


def test_a_checkpoint_of_another_model_is_refused_naming_the_entries(tmp_path):
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "small", GPT(vocab=64, d_model=32, n_layers=2, max_len=16))
    with pytest.raises(ConstraintError, match=r"lacks \d+ entries .*blocks\.2\."):
        load_checkpoint(tmp_path / "small", GPT(vocab=64, d_model=32, n_layers=4, max_len=16))
    with pytest.raises(ConstraintError, match=r"another shape .*wte\.weight: \(64, 32\) saved, \(64, 16\) here"):
        load_checkpoint(tmp_path / "small", GPT(vocab=64, d_model=16, n_layers=2, max_len=16), strict=False)
    with pytest.raises(ConstraintError, match="no optimizer state"):
        model = GPT(vocab=64, d_model=32, n_layers=2, max_len=16)
        load_checkpoint(tmp_path / "small", model, torch.optim.Adam(model.parameters()))


# -- materialise, one stage in this process ---------------------------------------------------------


def _stage_of(model: nn.Module, stages: int, stage: int):
    """Stage ``stage`` of an even split of ``model`` (meta), cut from a meta copy, and its names."""
    import autosplit
    from autosplit.runtime.batches import ChainsByRows, meta_copy

    tokens = torch.randint(0, 64, (4, 16))
    planner = autosplit.Planner(model, ["cpu"] * stages, example_inputs=(tokens,), micro_batches=2, **NO_SEARCH)
    plan = planner.plan()
    meta = meta_copy(model)
    chain, _ = ChainsByRows(meta, planner.traced.captured, ((tokens,), {}), plan, stages, method=planner.traced.captured.method,
                            replicate={p.name for p in plan.shared_params if p.policy == "replicate"}).at(2)
    return chain.stages[stage], StageNames.of(meta, chain.stages[stage]), meta


def test_default_init_is_each_modules_own_seeded_by_name_and_recomputes_non_persistent_buffers():
    with torch.device("meta"):
        model = GPT(vocab=64, d_model=32, n_layers=4, max_len=16)
    first, names_a, _ = _stage_of(model, 2, 0)
    again, names_b, _ = _stage_of(model, 2, 0)
    materialise(first, names_a, torch.device("cpu"), model=model, weights=None)
    materialise(again, names_b, torch.device("cpu"), model=model, weights=None)
    a, b = _tensors(first), _tensors(again)
    for fqn, local in names_a.tensors.items():  # every rank materialising these modules gets the same values
        torch.testing.assert_close(a[local], b[names_b.tensors[fqn]], msg=fqn)
    assert torch.equal(a[names_a.tensors["blocks.0.attn.causal"]], torch.tril(torch.ones(16, 16, dtype=torch.bool)))
    assert 0.015 < float(a[names_a.tensors["blocks.0.fc.weight"]].std()) < 0.025  # GPT's own _init_weights: N(0, 0.02)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])  # the user's model stays on meta


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict([*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)])


class Unfilled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(16))  # no reset_parameters fills it
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


def test_a_tensor_nothing_initialises_or_the_checkpoint_lacks_is_refused_by_name():
    import autosplit

    with torch.device("meta"):
        model = Unfilled()
    planner = autosplit.Planner(model, ["cpu"], example_inputs=(torch.randn(4, 16),), **NO_SEARCH)
    from autosplit.runtime.batches import ChainsByRows, meta_copy

    plan = planner.plan()
    meta = meta_copy(model)
    chain, _ = ChainsByRows(meta, planner.traced.captured, ((torch.randn(4, 16),), {}), plan, 1, method="symbolic_trace",
                            replicate=set()).at(4)
    stage = chain.stages[0]
    names = StageNames.of(meta, stage)
    with pytest.raises(ConstraintError, match=r"never given a value \(first: \['scale'\]\).*no reset_parameters"):
        materialise(stage, names, torch.device("cpu"), model=model, weights=None)
    with pytest.raises(ConstraintError, match=r"weights= lacks 2 entries this stage needs \(first: \['fc.weight', 'fc.bias'\]\)"):
        materialise(stage, names, torch.device("cpu"), model=model, weights={"scale": torch.ones(16)})
    with pytest.raises(ConstraintError, match=r"wrong shape.*scale: \(8,\) in the checkpoint, \(16,\) in the model"):
        materialise(stage, names, torch.device("cpu"), model=model, weights={"scale": torch.ones(8)})
    real = Unfilled()
    with pytest.raises(ConstraintError, match="already real"):
        materialise(stage, names, torch.device("cpu"), model=real, weights={"scale": torch.ones(16)})


def _real_model_kept_only_for_the_stage(*, rank: int, world: int) -> None:
    import gc
    import weakref

    import autosplit

    torch.manual_seed(0)
    model = _build("gpt")
    batches = _batches("gpt")
    pipe = autosplit.distribute(model, ["cpu"] * 2, example_inputs=(batches[0][0],), loss_fn=_loss, micro_batches=4, **NO_SEARCH)
    mine = {id(p) for p in pipe.parameters()}
    others = [weakref.ref(p) for p in model.parameters() if id(p) not in mine]
    assert others, "each stage holds part of the model"
    del model
    gc.collect()
    assert all(r() is None for r in others), "autosplit kept parameters of other stages alive"
    x, y = batches[0]
    pipe.step(x, target=y)


def test_a_real_models_other_stages_are_freed_once_the_caller_drops_it(gloo):
    gloo(2).run(_real_model_kept_only_for_the_stage, [()])

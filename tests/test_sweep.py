"""Sweeps at their floor: a sweep's sum outputs are one matrix product per block, with the bits
of each output computed alone, for any number of workers and threads; DCP outputs store chunks
of bounded size, so a sweep holds a few small regions per output, never a shard of each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ema_ckpt.commands.accumulate import accumulate
from ema_ckpt.commands.averaging import posthoc
from ema_ckpt.engine import OutputSpec, Update, blas_probe, combine_regions
from ema_ckpt.formats import open_checkpoint
from ema_ckpt.formats.dcp.output import DcpOutput
from ema_ckpt.layout import Box, boxes_cover
from ema_ckpt.writers.regions import DEFAULT_CHUNK_BYTES
from tests.dcp_helpers import write_dcp
from tests.ema_reference import full_load
from tests.test_engine import FakeReader, FakeWriter, _tensors

STEPS = (100, 180, 250, 400, 520)
SIGMAS = ("0.05", "0.10", "0.15")


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def sequence(tmp_path_factory) -> Path:
    """Five FSDP-style checkpoints (2 ranks) with the shapes that stress blocking: odd rows, a
    1-D tensor whose last block is one element, a one-element tensor, a scalar, bf16, int64."""
    root = tmp_path_factory.mktemp("sweep")
    g = torch.Generator().manual_seed(17)
    for step in STEPS:
        write_dcp(root / f"step_{step}", {
            "model.w": torch.randn(301, 257, generator=g),
            "model.v": torch.randn(4081, generator=g),
            "model.one": torch.randn(1, generator=g),
            "model.scale": torch.tensor(float(step)),
            "model.h": torch.randn(64, 33, generator=g).to(torch.bfloat16),
            "model.count": torch.tensor(step, dtype=torch.int64),
        }, world_size=2)
    return root


def test_a_sweep_equals_each_output_computed_alone(sequence, tmp_path, monkeypatch):
    # small blocks: many per region, uneven, and (5 sources × 4 bytes into 4 KiB: 204 elements
    # per block) a last block of one element for model.v
    monkeypatch.setattr(blas_probe, "SWEEP_STACK_BYTES", 4096)
    together = posthoc(sequence, out=tmp_path / "together", sigma_rels=list(SIGMAS))
    assert [o.name for o in together.outputs] == [f"sigma_rel_{s}" for s in SIGMAS]
    for sigma in SIGMAS:
        alone = posthoc(sequence, out=tmp_path / f"alone-{sigma}", sigma_rels=[sigma])
        a = full_load(alone.outputs[0], tmp_path)
        b = full_load(tmp_path / "together" / f"sigma_rel_{sigma}", tmp_path)
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), (sigma, key)


def test_sweep_bits_do_not_depend_on_workers_or_threads(sequence, tmp_path):
    trees = []
    for workers, threads in ((1, 1), (2, 3)):
        out = tmp_path / f"w{workers}-t{threads}"
        proc = subprocess.run(
            [sys.executable, "-m", "ema_ckpt", "posthoc", str(sequence), "--sigma-rel", ",".join(SIGMAS),
             "--out", str(out), "--workers", str(workers), "--quiet"],
            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        trees.append(_tree(out))
    assert trees[0] == trees[1]


def test_an_output_that_skips_a_source_is_not_in_the_product():
    """Only outputs over the same sources share the product: one that skips a source holding
    Inf must not see it at weight 0 (0 · Inf is NaN)."""
    base = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    poisoned = base.clone()
    poisoned[2, 1] = float("inf")
    readers = [FakeReader({"w": base + s}) for s in range(3)]
    readers[1] = FakeReader({"w": poisoned})
    outputs = [
        OutputSpec("a", (Update(0, 0.5), Update(1, 0.25), Update(2, 0.25)), mode="sum"),
        OutputSpec("b", (Update(0, 0.2), Update(1, 0.3), Update(2, 0.5)), mode="sum"),
        OutputSpec("c", (Update(0, 0.5), Update(2, 0.5)), mode="sum"),
    ]
    writers = [FakeWriter() for _ in outputs]
    tensors = _tensors(readers[0])
    regions = writers[0].plan(tensors, readers[0])
    for w in writers[1:]:
        w.plan(tensors, readers[0])
    combine_regions(readers, outputs, writers, regions, {t.key: t for t in tensors}, copy_source=2)
    assert torch.isfinite(writers[2].written["w"]).all()
    assert torch.equal(writers[2].written["w"], torch.mul(base, 0.5).add_(base + 2, alpha=0.5))
    assert torch.isinf(writers[0].written["w"][2, 1])


def test_large_stored_chunks_are_written_as_bounded_chunks(tmp_path):
    """A 40 MiB shard becomes whole-row chunks of at most 16 MiB; a reshard keeps one per rank."""
    rows = (40 << 20) // (1024 * 4)
    g = torch.Generator().manual_seed(5)
    for step in (10, 20):
        write_dcp(tmp_path / "ck" / f"step_{step}",
                  {"model.w": torch.randn(rows, 1024, generator=g), "model.b": torch.randn(7, generator=g)})
    reader = open_checkpoint(tmp_path / "ck" / "step_20")
    tensors = [t for t in _output_tensors(reader)]
    regions = DcpOutput(tmp_path / "staging", "x").plan(tensors, reader)
    big = [r.box for r in regions if r.key == "model.w"]
    assert len(big) == 3 and all(b.numel * 4 <= DEFAULT_CHUNK_BYTES and b.sizes[1:] == (1024,) for b in big)
    assert boxes_cover((rows, 1024), big)
    resharded = DcpOutput(tmp_path / "staging", "x", world_size=2).plan(tensors, reader)
    assert [r.box.sizes for r in resharded if r.key == "model.w"] == [(rows // 2, 1024)] * 2

    # the EMA stores the cut chunks; folding the next checkpoint into it reads them chunk for chunk,
    # and an incremental run gives the bits of a one-shot run
    one_shot = accumulate(tmp_path / "ck", decay=0.9, out=tmp_path / "one-shot")
    first = tmp_path / "first"
    (first / "step_10").mkdir(parents=True)
    for item in (tmp_path / "ck" / "step_10").iterdir():
        (first / "step_10" / item.name).write_bytes(item.read_bytes())
    accumulate(first, decay=0.9, out=tmp_path / "inc")
    (first / "step_20").mkdir()
    for item in (tmp_path / "ck" / "step_20").iterdir():
        (first / "step_20" / item.name).write_bytes(item.read_bytes())
    accumulate(first, decay=0.9, out=tmp_path / "inc")
    ema = open_checkpoint(tmp_path / "inc")
    assert [c.box for c in ema.chunks("model.w")] == big
    a, b = full_load(one_shot.outputs[0], tmp_path), full_load(tmp_path / "inc", tmp_path)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _output_tensors(reader):
    from ema_ckpt.writers.base import OutputTensor

    return [OutputTensor(k, k, s.shape, str(s.dtype).removeprefix("torch."), str(s.dtype).removeprefix("torch."))
            for k, s in reader.specs().items()]


def test_block_product_matches_the_loop_for_every_block_width():
    """Where the product is used (this machine's BLAS passed the probe for the shape), its bits
    equal the one-output loop's at every width, the one-column fallback included."""
    g = torch.Generator().manual_seed(0)
    for sources, outputs in ((2, 2), (4, 4), (5, 3), (16, 8)):
        if not blas_probe.product_is_exact(outputs, sources, torch.float32):
            continue  # such sweeps are computed by the loop itself (the next test)
        coefficients = torch.randn(outputs, sources, dtype=torch.float64, generator=g).to(torch.float32)
        for width in (1, 2, 3, 5, 16, 17, 1000):
            stack = torch.randn(sources, width, generator=g)
            sweep = blas_probe.Sweep(tuple(range(outputs)), frozenset(range(outputs)), tuple(range(sources)),
                                  {s: s for s in range(sources)}, coefficients)
            out = torch.empty(outputs, width)
            sweep.combine(stack, out)
            for k in range(outputs):
                loop = torch.mul(stack[0], float(coefficients[k, 0]))
                for s in range(1, sources):
                    loop.add_(stack[s], alpha=float(coefficients[k, s]))
                assert torch.equal(out[k], loop), (sources, outputs, width, k)
    assert Box((0,), (1,)).numel == 1


def test_where_the_product_is_not_exact_a_sweep_is_the_loop(sequence, tmp_path, monkeypatch):
    """A BLAS that groups the terms otherwise (MKL on AMD processors) never computes a sweep:
    its outputs are the loop's, the bits of each output computed alone."""
    monkeypatch.setattr(blas_probe, "product_is_exact", lambda outputs, sources, dtype: False)
    used: list[int] = []
    real = blas_probe.Sweep.combine
    monkeypatch.setattr(blas_probe.Sweep, "combine", lambda self, stack, out: used.append(1) or real(self, stack, out))
    together = posthoc(sequence, out=tmp_path / "together", sigma_rels=list(SIGMAS[:2]))
    assert not used
    alone = posthoc(sequence, out=tmp_path / "alone", sigma_rels=[SIGMAS[1]])
    a, b = full_load(alone.outputs[0], tmp_path), full_load(together.outputs[1], tmp_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_probe_finds_a_product_that_is_not_the_loop(monkeypatch):
    """The probe compares bits: a product one rounding away from the loop is refused."""
    blas_probe.product_is_exact.cache_clear()
    real_mm = torch.mm

    def off_by_one_ulp(a, b, **kwargs):
        out = real_mm(a, b, **kwargs)
        return torch.nextafter(out, torch.full_like(out, float("inf")))

    monkeypatch.setattr(blas_probe.torch, "mm", off_by_one_ulp)
    try:
        assert blas_probe.product_is_exact(3, 5, torch.float32) is False
    finally:
        blas_probe.product_is_exact.cache_clear()


def test_only_copies_may_plan_raw_regions():
    """A computed output never takes a source's stored bytes: the engine refuses raw regions for it."""
    reader = FakeReader({"w": torch.ones(4, 2)})
    writer = FakeWriter()
    writer.raw_keys = {"w"}
    tensors = _tensors(reader)
    regions = writer.plan(tensors, reader)
    assert all(r.raw for r in regions)
    for mode in ("fold", "sum"):
        with pytest.raises(ValueError, match="only copy outputs"):
            combine_regions([reader], [OutputSpec("x", (Update(0, 1.0),), mode=mode)], [writer], regions,
                            {t.key: t for t in tensors}, copy_source=0)


def test_a_sweep_names_the_checkpoint_holding_nan(tmp_path):
    from ema_ckpt.errors import NonFiniteError

    g = torch.Generator().manual_seed(2)
    for step in (10, 20, 30):
        w = torch.randn(64, 16, generator=g)
        if step == 20:
            w[5, 3] = float("nan")
        write_dcp(tmp_path / "ck" / f"step_{step}", {"model.w": w})
    with pytest.raises(NonFiniteError, match="step_20"):
        posthoc(tmp_path / "ck", out=tmp_path / "out", sigma_rels=list(SIGMAS))
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())

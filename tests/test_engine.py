"""The engine's one loop, on fake readers and writers: arithmetic, casts, copies, NaN checks,
raw copies, progress, single reads, and how files are shared among workers."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ema_ckpt.dist import Workers
from ema_ckpt.dtypes import name_of
from ema_ckpt.engine import OutputSpec, Update, combine_regions
from ema_ckpt.errors import NonFiniteError
from ema_ckpt.job_context import regions_by_file
from ema_ckpt.layout import Box, TensorSpec, split_rows
from ema_ckpt.writers.base import OutputTensor, OutputWriter, PlannedRegion, WrittenFile


class FakeReader:
    """An in-memory checkpoint: every tensor stored in row chunks of ``rows`` rows."""

    format_name = "fake"
    step = None
    supports_out = False

    def __init__(self, tensors: dict[str, torch.Tensor], rows: int = 2, path: str = "fake") -> None:
        self.tensors = tensors
        self.rows = rows
        self.path = Path(path)
        self.reads: list[tuple[str, Box]] = []

    def specs(self) -> dict[str, TensorSpec]:
        return {k: TensorSpec(k, tuple(t.shape), t.dtype) for k, t in self.tensors.items()}

    def layout(self, key: str) -> list[Box]:
        shape = tuple(self.tensors[key].shape)
        return split_rows(Box.full(shape), max(1, self.rows * (shape[1] if len(shape) > 1 else 1)))

    def read(self, key: str, box: Box) -> torch.Tensor:
        self.reads.append((key, box))
        return self.tensors[key][box.slices()].clone()

    def info(self) -> dict[str, object]:
        return {}

    def close(self) -> None:
        pass


class FakeWriter(OutputWriter):
    """Keeps what it is given; one file per tensor, regions follow the source's layout."""

    name = "fake"

    def __init__(self, fail_on: str | None = None) -> None:
        super().__init__(Path("unused"), "fake")
        self.written: dict[str, torch.Tensor] = {}
        self.copied: list[str] = []
        self.fail_on = fail_on
        self.raw_keys: set[str] = set()

    def plan(self, tensors, source):
        regions = []
        for t in tensors:
            for box in source.layout(t.key):
                raw = t.key in self.raw_keys
                regions.append(PlannedRegion(t.key, box if not raw else Box.full(t.shape), f"file-{t.key}",
                                             box.numel * 4, raw=raw))
                if raw:
                    break
        self.tensors = {t.key: t for t in tensors}
        return regions

    def write(self, region, tensor):
        if region.key == self.fail_on:
            raise OSError(28, "No space left on device")
        t = self.tensors[region.key]
        whole = self.written.setdefault(region.key, torch.empty(t.shape, dtype=tensor.dtype))
        whole[region.box.slices()] = tensor

    def copy_stored(self, region, source):
        self.copied.append(region.key)

    def close(self):
        return sorted(self.written)

    def finish(self, states):
        return [WrittenFile(name, 0) for state in states for name in state]


def _tensors(reader: FakeReader, dtype: str | None = None) -> list[OutputTensor]:
    out = []
    for key, t in reader.tensors.items():
        stored = name_of(t.dtype)
        out.append(OutputTensor(key, key, tuple(t.shape), dtype if dtype and t.dtype.is_floating_point else stored,
                                stored))
    return out


def _run(sources, outputs, writers, tensors, **kwargs):
    regions = writers[0].plan(tensors, sources[-1])
    for w in writers[1:]:
        w.plan(tensors, sources[-1])
    return combine_regions(sources, outputs, writers, regions, {t.key: t for t in tensors},
                           copy_source=len(sources) - 1, **kwargs)


def _checkpoints(n: int, shape=(7, 5), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [FakeReader({"w": torch.randn(shape, generator=gen), "step": torch.tensor([i], dtype=torch.int64)},
                       path=f"ckpt{i}") for i in range(n)]


def test_fold_is_the_sequence_of_lerps_bit_for_bit():
    sources = _checkpoints(4)
    weights = [1.0, 0.3, 0.2, 0.1]
    writer = FakeWriter()
    _run(sources, [OutputSpec("ema", tuple(Update(i, w) for i, w in enumerate(weights)))], [writer],
         _tensors(sources[-1], "float32"), accumulate_dtype=torch.float32)
    expected = sources[0].tensors["w"].clone()
    for s, w in zip(sources[1:], weights[1:], strict=True):
        expected.lerp_(s.tensors["w"], w)
    assert torch.equal(writer.written["w"], expected)
    assert torch.equal(writer.written["step"], sources[-1].tensors["step"])  # non-float: the newest's


def test_sum_with_negative_weights_matches_a_float64_reference():
    sources = _checkpoints(3)
    coefficients = [-0.25, 0.5, 0.75]
    writer = FakeWriter()
    _run(sources, [OutputSpec("phema", tuple(Update(i, c) for i, c in enumerate(coefficients)), mode="sum")],
         [writer], _tensors(sources[-1], "float64"), accumulate_dtype=torch.float64)
    reference = sum(c * s.tensors["w"].double() for c, s in zip(coefficients, sources, strict=True))
    assert writer.written["w"].dtype == torch.float64
    torch.testing.assert_close(writer.written["w"], reference, rtol=0, atol=1e-12)


def test_every_output_reads_each_source_region_once():
    sources = _checkpoints(3)
    writers = [FakeWriter() for _ in range(5)]
    outputs = [OutputSpec(f"o{k}", (Update(0, 0.2), Update(1, 0.3), Update(2, 0.5)), mode="sum") for k in range(5)]
    _run(sources, outputs, writers, _tensors(sources[-1], "float32"), accumulate_dtype=torch.float32)
    regions = len(sources[-1].layout("w"))
    for source in sources[:2]:
        assert len([r for r in source.reads if r[0] == "w"]) == regions
    for a, b in itertools.pairwise(writers):
        assert torch.equal(a.written["w"], b.written["w"])


def test_copy_casts_floats_and_keeps_integers():
    [source] = _checkpoints(1)
    writer = FakeWriter()
    _run([source], [OutputSpec("out", (Update(0, 1.0),), mode="copy")], [writer], _tensors(source, "bfloat16"))
    assert writer.written["w"].dtype == torch.bfloat16
    assert torch.equal(writer.written["w"], source.tensors["w"].to(torch.bfloat16))
    assert writer.written["step"].dtype == torch.int64


def test_nan_in_a_checked_source_names_it_and_an_unchecked_one_passes():
    sources = _checkpoints(3)
    sources[1].tensors["w"][3, 2] = float("nan")
    spec = [OutputSpec("ema", (Update(0, 1.0), Update(1, 0.5), Update(2, 0.5)))]
    with pytest.raises(NonFiniteError) as err:
        _run(sources, spec, [FakeWriter()], _tensors(sources[-1], "float32"), check_finite=[1, 2])
    assert err.value.source == 1 and "ckpt1" in str(err.value)
    writer = FakeWriter()
    _run(sources, spec, [writer], _tensors(sources[-1], "float32"), check_finite=[2])
    assert torch.isnan(writer.written["w"]).any()


def test_raw_regions_are_copied_as_stored_and_never_read():
    [source] = _checkpoints(1)
    writer = FakeWriter()
    writer.raw_keys = {"w"}
    stats = _run([source], [OutputSpec("out", (Update(0, 1.0),), mode="copy")], [writer], _tensors(source))
    assert writer.copied == ["w"] and "w" not in writer.written
    assert all(key != "w" for key, _ in source.reads)
    assert stats.bytes_read > 0


def test_progress_reaches_the_total_in_order():
    sources = _checkpoints(2)
    seen = []
    _run(sources, [OutputSpec("ema", (Update(0, 1.0), Update(1, 0.5)))], [FakeWriter()],
         _tensors(sources[-1], "float32"), on_progress=seen.append)
    assert [p.regions_done for p in seen] == list(range(1, len(seen) + 1))
    assert seen[-1].bytes_done == seen[-1].bytes_total and seen[-1].fraction == 1.0


def test_a_failing_writer_stops_the_loop_with_its_error():
    sources = _checkpoints(2, shape=(600, 600))  # regions large enough for the background writer
    with pytest.raises(OSError, match="No space"):
        _run(sources, [OutputSpec("ema", (Update(0, 1.0), Update(1, 0.5)))], [FakeWriter(fail_on="w")],
             _tensors(sources[-1], "float32"))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), chunk=st.integers(1, 9), cols=st.integers(1, 4), n=st.integers(1, 4))
def test_the_result_does_not_depend_on_how_the_tensor_is_cut(rows, chunk, cols, n):
    gen = torch.Generator().manual_seed(rows * 100 + chunk * 10 + cols)
    data = [torch.randn(rows, cols, generator=gen) for _ in range(n)]
    weights = [1.0] + [0.37] * (n - 1)
    results = []
    for cut in (chunk, rows):
        sources = [FakeReader({"w": d}, rows=cut) for d in data]
        writer = FakeWriter()
        _run(sources, [OutputSpec("ema", tuple(Update(i, w) for i, w in enumerate(weights)))], [writer],
             _tensors(sources[-1], "float32"))
        results.append(writer.written["w"])
    assert torch.equal(results[0], results[1])


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 1 << 22), min_size=1, max_size=30), world=st.integers(1, 6),
       per_file=st.integers(1, 4))
def test_workers_share_whole_files_each_exactly_once(sizes, world, per_file):
    # without a store of the group's own (a group formed elsewhere), files are shared out beforehand
    regions = [PlannedRegion(f"k{i}", Box((0,), (1,)), f"f{i // per_file}", size) for i, size in enumerate(sizes)]
    files = regions_by_file(regions)
    assert [r for part in files for r in part] == regions  # regions of a file stay in planned order
    assert all(len({r.file for r in part}) == 1 for part in files)
    costs = [sum(r.nbytes for r in part) for part in files]
    shares = [list(Workers(rank, world).claims(costs)) for rank in range(world)]
    assert sorted(i for share in shares for i in share) == list(range(len(files)))
    assert shares == [list(Workers(rank, world).claims(costs)) for rank in range(world)]  # deterministic
    for share in shares:  # each in the order offered
        order = Workers(0, world).claim_order(costs)
        assert share == sorted(share, key=order.index)


def test_many_outputs_take_smaller_blocks_with_the_bits_of_each_output_alone(monkeypatch):
    """K outputs cut a region into smaller row blocks (so a source's block and the accumulators
    stay in cache) than one output does; the bits are those of each output computed alone, for
    sums (a sweep on the per-output path, as where the product is not exact) and for folds."""
    from ema_ckpt.engine import blas_probe

    assert blas_probe.block_budget(1) == blas_probe.block_budget(2) == 2 << 20
    assert blas_probe.block_budget(4) == 1 << 20
    assert blas_probe.block_budget(8) == blas_probe.block_budget(64) == 512 << 10
    monkeypatch.setattr(blas_probe, "product_is_exact", lambda *args: False)
    budgets: list[int] = []
    real_blocks = blas_probe.row_blocks

    def spy(box, itemsize, device, budget=blas_probe._BLOCK_BYTES):
        budgets.append(budget)
        return real_blocks(box, itemsize, device, budget)

    monkeypatch.setattr(blas_probe, "row_blocks", spy)
    gen = torch.Generator().manual_seed(3)
    sources = [FakeReader({"w": torch.randn(3001, 257, generator=gen)}, rows=3001, path=f"ckpt{i}")
               for i in range(5)]  # one region of 2.9 MiB: 2 blocks alone, 6 with eight outputs
    weights = (torch.rand(8, 5, generator=gen, dtype=torch.float64) - 0.3).tolist()
    sums = [OutputSpec(f"s{k}", tuple(Update(i, w) for i, w in enumerate(row)), mode="sum")
            for k, row in enumerate(weights)]
    folds = [OutputSpec(f"f{k}", (Update(0, 1.0), *(Update(i, abs(w) % 1) for i, w in enumerate(row[1:], 1))))
             for k, row in enumerate(weights)]
    for specs in (sums, folds):
        budgets.clear()
        together = [FakeWriter() for _ in specs]
        _run(sources, specs, together, _tensors(sources[-1], "float32"), accumulate_dtype=torch.float32)
        assert budgets == [512 << 10]
        for spec, writer in zip(specs, together, strict=True):
            budgets.clear()
            alone = FakeWriter()
            _run(sources, [spec], [alone], _tensors(sources[-1], "float32"), accumulate_dtype=torch.float32)
            assert budgets == [2 << 20]
            assert torch.equal(writer.written["w"], alone.written["w"]), spec.name

import pytest
import torch

from ema_ckpt.discovery import discover, step_from_name
from ema_ckpt.errors import CheckpointNotFoundError, IncompatibleCheckpointError, UnplacedCheckpointError, UsageError
from tests.dcp_helpers import write_dcp


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("step_1000", 1000), ("step-1000", 1000), ("global_step1000", 1000), ("checkpoint-1000", 1000),
        ("iter_0001000", 1000), ("epoch=3-step=1000", 1000), ("1000", 1000), ("step1000", 1000),
        ("latest", None), ("epoch=3", None), ("steps", None),
    ],
)
def test_step_from_name(name, step):
    assert step_from_name(name) == step


def test_step_regex_overrides():
    assert step_from_name("run7_ckpt_0042", r"ckpt_(\d+)") == 42
    assert step_from_name("run7_ckpt_0042", r"run(?P<step>\d+)") == 7
    with pytest.raises(UsageError, match="not a valid regular expression"):
        step_from_name("x", "(")


def _ckpt(path):
    return write_dcp(path, {"model.w": torch.zeros(2)})


def test_sorted_by_step_skipping_partial_outputs_and_hidden(tmp_path):
    for name in ["step_20", "step_3", "step_100"]:
        _ckpt(tmp_path / name)
    partial = tmp_path / "step_200"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"x")
    ema = _ckpt(tmp_path / "ema")
    (ema / "ema-ckpt.json").write_text("{}")
    _ckpt(tmp_path / ".ema.tmp-1-abcd")
    (tmp_path / "notes").mkdir()
    found = discover([tmp_path])
    assert [c.step for c in found.checkpoints] == [3, 20, 100]
    assert any("step_200" in n and "no .metadata yet" in n for n in found.notes)


def test_excluded_output_is_never_an_input(tmp_path):
    _ckpt(tmp_path / "step_1")
    _ckpt(tmp_path / "out" / "step_5")  # an --out inside the folder, even before a manifest exists
    _ckpt(tmp_path / "step_9")
    found = discover([tmp_path], exclude=[tmp_path / "step_9"])
    assert [c.step for c in found.checkpoints] == [1]


def test_duplicate_steps_with_different_weights_are_refused(tmp_path):
    _ckpt(tmp_path / "step_5")
    write_dcp(tmp_path / "global_step5", {"model.w": torch.ones(2)})
    with pytest.raises(IncompatibleCheckpointError, match="both hold step 5 with different weights"):
        discover([tmp_path])


def test_finding_the_components_alone_compares_no_weights(tmp_path, monkeypatch):
    import ema_ckpt.copies

    _ckpt(tmp_path / "step_5")
    write_dcp(tmp_path / "global_step5", {"model.w": torch.ones(2)})
    monkeypatch.setattr(ema_ckpt.copies, "same_model_bytes", lambda *_: pytest.fail("weights were compared"))
    found = discover([tmp_path], all_components=True, require=False, compare=False)
    assert found.components == [""] and len(found.checkpoints) == 2


def test_duplicate_steps_with_the_same_weights_count_once(tmp_path):
    _ckpt(tmp_path / "step_5")
    _ckpt(tmp_path / "global_step5")
    _ckpt(tmp_path / "step_7")
    found = discover([tmp_path])
    assert [(c.path.name, c.step) for c in found.checkpoints] == [("global_step5", 5), ("step_7", 7)]
    assert any("skipped" in n and "step_5" in n and "the same weights as" in n for n in found.notes)


def test_a_nan_in_both_copies_still_counts_as_the_same_bytes(tmp_path):
    write_dcp(tmp_path / "step_5", {"model.w": torch.tensor([float("nan"), 1.0])})
    write_dcp(tmp_path / "global_step5", {"model.w": torch.tensor([float("nan"), 1.0])})
    assert len(discover([tmp_path]).checkpoints) == 1


def test_skipped_checkpoints_are_noted(tmp_path):
    _ckpt(tmp_path / "step_1")
    _ckpt(tmp_path / "step_2")
    found = discover([tmp_path], skip=[tmp_path / "step_2"])
    assert [c.step for c in found.checkpoints] == [1]
    assert any("step_2" in n and "left out (skip)" in n and n.mentions == ("skip",) for n in found.notes)


def test_empty_folder_and_explicit_partial_directory(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no checkpoints found"):
        discover([tmp_path])
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointNotFoundError, match=r"no \.metadata yet"):
        discover([tmp_path / "step_1"])


def test_explicit_checkpoint_paths(tmp_path):
    a, b = _ckpt(tmp_path / "step_7"), _ckpt(tmp_path / "step_2")
    assert [c.step for c in discover([a, b]).checkpoints] == [2, 7]


def test_folders_named_like_a_trainers_nesting_stay_folders_of_checkpoints(tmp_path):
    for name in ("step_100", "step_200", "weights"):
        _ckpt(tmp_path / name)
    (tmp_path / "context").mkdir()  # NeMo's pair, but weights/ holds no Megatron metadata.json
    # weights/ is a checkpoint like the others, with no step: never folded silently beside them
    with pytest.raises(UnplacedCheckpointError, match="weights: no step in its records or its name"):
        discover([tmp_path])
    assert [c.step for c in discover([tmp_path], skip=[tmp_path / "weights"]).checkpoints] == [100, 200]


def test_a_stale_file_of_a_later_format_does_not_hide_a_complete_checkpoint(tmp_path):
    _ckpt(tmp_path / "step_200")
    index = tmp_path / "step_200" / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"w": "gone.safetensors"}}')
    assert [c.step for c in discover([tmp_path]).checkpoints] == [200]


def test_a_symlinked_checkpoints_folder_is_not_followed_round(tmp_path):
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "checkpoints").symlink_to(tmp_path / "proj")
    with pytest.raises(CheckpointNotFoundError, match="no checkpoints found"):
        discover([tmp_path / "proj"])


def test_a_steps_two_copies_of_one_file_are_one_checkpoint(tmp_path):
    _ckpt(tmp_path / "step_5")
    (tmp_path / "global_step5").symlink_to(tmp_path / "step_5")
    found = discover([tmp_path])
    assert len(found.checkpoints) == 1 and any("the same step 5" in n for n in found.notes)

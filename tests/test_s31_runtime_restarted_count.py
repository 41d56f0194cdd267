"""fp8_stats in a run that loads a full checkpoint but restarts the step count
(`load_ignore_keys: [state/timestamp]`: a new data mix, a second phase), read back from W&B's
own history. The restored heatmap history held the earlier run's logging steps (0 to 3) before
this run's (0 to 2 again), and its next image step (4) held this run's heatmaps back until its
end: W&B got none at step 2 (`image_interval: 2ba`), only one at the end, drawn from both runs'
steps. Now the steps start again with their heatmaps, as after `fit(reset_time=True)`."""

from __future__ import annotations

import pytest

from foundry_fp8 import wandb_history
from tests.tiny_run import run_folder, run_tiny

STATS = {"fp8_stats": {"interval": "1ba", "image_interval": "2ba"}}


@pytest.mark.slow
def test_a_restarted_step_count_logs_its_heatmaps_at_its_own_image_steps(tmp_path, tiny_data):
    run_tiny(tmp_path, tiny_data, {"variables": {"run_name": "first"}, "max_duration": "4ba",
                                   "save_interval": "4ba", "eval_interval": "4ba",
                                   "callbacks": STATS}).close()
    checkpoint = str(run_folder(tmp_path, "first") / "checkpoints" / "ep0-ba4-rank0.pt")
    trainer = run_tiny(tmp_path, tiny_data, {
        "variables": {"run_name": "second"}, "max_duration": "3ba", "save_interval": "3ba",
        "eval_interval": "3ba", "callbacks": STATS, "load_path": checkpoint,
        "load_ignore_keys": ["state/timestamp"]}, wandb=True)
    assert int(trainer.state.timestamp.batch) == 3  # the step count did restart
    trainer.close()

    [run] = wandb_history.read_runs(run_folder(tmp_path, "second"), wait=120)
    assert run.complete and run.steps("loss/train/total") == [0, 1, 2]
    images = run.media("images/separated")
    heatmaps = {key for key in images if key.startswith("fp8_heatmap/")}
    assert heatmaps and all(images[key] == [2] for key in heatmaps), images

"""The report's command line where a user's words would do nothing or something unasked (E20):
loss-gap options without a baseline, `mlflow:<run id>` without a tracking server."""

from __future__ import annotations

import pytest

from foundry_fp8.cli import main


@pytest.mark.parametrize(("options", "said"), [
    (["--max-loss-gap", "5"], "--max-loss-gap without --baseline: it tells"),
    (["--loss-gap-steps", "3"], "--loss-gap-steps without --baseline: it tells"),
    (["--max-loss-gap", "5", "--loss-gap-steps", "3"],
     "--max-loss-gap and --loss-gap-steps without --baseline: they tell"),
])
def test_loss_gap_options_without_a_baseline_are_refused(tmp_path, capsys, options, said):
    """They were ignored without a word (exit 0): a divergence check the user believed on."""
    assert main(["report", str(tmp_path / "absent"), *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {said} where the loss departs from a baseline's") and \
        err.count("\n") == 1, err


def test_mlflow_run_id_without_a_tracking_uri_creates_no_store(tmp_path, monkeypatch, capsys):
    """With MLFLOW_TRACKING_URI unset, MLflow's client made ./mlruns/{.trash,0} in the working
    directory (its default store) before answering "Run 'abc' not found"."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["report", "mlflow:abc"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: mlflow:abc: MLFLOW_TRACKING_URI is not set, and MLflow's default "
                   "store, ./mlruns, is not here: set MLFLOW_TRACKING_URI to the run's tracking "
                   "server, or name the run's folder (mlruns/<experiment id>/<run id>)\n"), err
    assert list(tmp_path.iterdir()) == []  # was mlruns/.trash, mlruns/0
    (tmp_path / "mlruns").mkdir()  # an existing default store is read, and said to be
    assert main(["report", "mlflow:abc"]) == 2
    assert capsys.readouterr().err == ("error: mlflow:abc: MLflow: Run 'abc' not found "
                                       "(MLFLOW_TRACKING_URI is not set: read ./mlruns)\n")

"""What a user reads about logged keys is what lands at the sinks. The keys named in the
docstrings of every entry this package registers with LLM-Foundry (setup.cfg's entry points)
and on the docs pages of those entries are compared with the keys one real run wrote: the tiny
MPT through LLM-Foundry's `train` with every entry on (te_swap with a layer excluded, fp8_lint,
fp8_state, fp8_stats with pictures and a dump, fp8_guard with a fallback, a budget refusal and
a re-promotion from injected outliers), then a second `fit()`, read back at the sinks: the
`.wandb` file with W&B's own reader (`wandb_history`), the jsonl logger's `metrics.jsonl` and
`hparams.json`, and the console. Layer, tensor and statistic names are compared as the docs'
placeholders (`fp8_<stat>/<tensor>/<layer>`). Keys the docs name that this run cannot log (TE's
own statistics need TE on a GPU, ...) are listed in `NOT_IN_THIS_RUN` with why."""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import re
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

import foundry_fp8
from foundry_fp8 import wandb_history
from foundry_fp8.fault import InjectOutlier
from foundry_fp8.health import SUMMARIES
from foundry_fp8.health.keys import MARKERS, parse_key
from foundry_fp8.jsonl import read_jsonl
from foundry_fp8.numerics import STAT_KEYS
from tests.tiny_run import run_folder, tiny_config

REPO = Path(__file__).resolve().parents[1]
SOURCES = Path(foundry_fp8.__file__).resolve().parents[1]  # where `foundry_fp8/...` is
GROUPS = ("llmfoundry_algorithms", "llmfoundry_callbacks", "llmfoundry_callbacks_with_config",
          "llmfoundry_loggers")
#: The pages of the registered entries, and README.md's tables of them (report.md describes
#: what the report reads, older layouts included: not what a run logs).
PAGES = ("README.md", "docs/te_swap.md", "docs/fp8_stats.md", "docs/fp8_guard.md",
         "docs/fp8_state.md", "docs/lint.md")
#: Documented keys this run cannot log, and why (each is still checked to be documented).
NOT_IN_THIS_RUN = {
    "fp8_uncast/<tensor>/<layer>": "needs NVTE_BACKWARD_OVERRIDE under current scaling",
    "fp8_te_<stat>/<tensor>/<layer>": "TE's debug statistics need TE on a GPU",
    "fp8/te_debug/<name>": "TE's debug statistics need TE on a GPU",
    "fp8/guard/summary/<layer>.ba<step>": "needs more than guard.KEPT_DECISIONS fallbacks",
    "fp8/layers.<n>": "needs a layer list over MLflow's 6000 characters",
}
END, INTERVAL, IMAGES, MORE = 10, 2, 4, 2  # MORE: the second fit's batches
STEPS = list(range(0, END + MORE, INTERVAL))  # fp8_stats' logging steps over both fits
OUT_PROJ, UP_PROJ, EXCLUDED = "blocks.1.attn.out_proj", "blocks.1.ffn.up_proj", \
    "blocks.0.ffn.down_proj"
KEY = re.compile(r"`((?:fp8(?:[a-z0-9_]|<[^>`]*>)*|\.\.\.)/(?:[^`<\s]|<[^>`]*>)+|fp8_table)`")


def normalized(key: str) -> str:
    """`key` as the docs' placeholders write it: `fp8_underflow_pct/gradient/blocks.0.attn.Wqkv`
    is `fp8_<stat>/<tensor>/<layer>`, `fp8/stats_summary.ba12` is `fp8/stats_summary.ba<step>`
    (the markers, `fp8_initial_scale/...`, keep their names)."""
    resumed = re.fullmatch(r"(.+)\.ba(?:\d+|<step>)", key)
    key, suffix = (resumed.group(1), ".ba<step>") if resumed else (key, "")
    parts = key.split("/")
    if parts[0] == "fp8_heatmap":
        key = "fp8_heatmap/<stat>"
    elif (parsed := parse_key(key)) is not None:
        stat = parsed[0]
        stat = stat if stat in MARKERS or stat == "<stat>" else \
            "te_<stat>" if stat.startswith("te_") else "<stat>"
        key = f"fp8_{stat}/<tensor>/<layer>"
    elif parts[:2] == ["fp8", "guard"] and len(parts) >= 4:
        key = f"fp8/guard/{parts[2]}/<layer>"
    elif parts[:2] == ["fp8", "te_debug"]:
        key = "fp8/te_debug/<name>"
    elif len(parts) == 3 and parts[0] == "fp8" and parts[2] in SUMMARIES:
        key = f"fp8/<tensor>/{parts[2]}"
    elif re.fullmatch(r"fp8/layers\.\d+", key):
        key = "fp8/layers.<n>"
    return key + suffix


def _documented(text: str, where: str, first_line: int = 1) -> dict[str, str]:
    """{normalized key: `file:line` of its first mention} of the backticked keys in `text`;
    `.../name` after a key on its line is that key's sibling (`fp8/<tensor>/worst_cos_sim`
    after `fp8/<tensor>/worst_underflow_pct`), any other with `...` (`fp8/guard/...`) names
    a family, not a key."""
    found: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), first_line):
        last = None
        for key in KEY.findall(line):
            if key.startswith(".../") and last is not None:
                key = f"{last.rpartition('/')[0]}/{key.removeprefix('.../')}"
            if "..." not in key:
                found.setdefault(normalized(key), f"{where}:{number}")
                last = key
    return found


def entry_classes() -> list[type]:
    classes = [entry.load() for group in GROUPS for entry in entry_points(group=group)
               if entry.value.startswith("foundry_fp8.")]
    assert len(classes) >= 6, classes  # te_swap, fp8_stats/state/guard/lint, jsonl
    return classes


def docstring_keys() -> dict[str, str]:
    found: dict[str, str] = {}
    for cls in entry_classes():
        lines, start = inspect.getsourcelines(cls)
        where = str(Path(inspect.getsourcefile(cls)).relative_to(SOURCES))
        text = "".join(lines)
        doc_at = start + text[:text.index('"""')].count("\n")
        for key, place in _documented(cls.__doc__ or "", where, doc_at).items():
            found.setdefault(key, place)
    return found


def page_keys() -> dict[str, str]:
    found: dict[str, str] = {}
    for page in PAGES:
        for key, place in _documented((REPO / page).read_text(), page).items():
            found.setdefault(key, place)
    return found


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_data) -> dict[str, Any]:
    """One run with every entry on, read back at every sink."""
    from llmfoundry.command_utils import train
    from llmfoundry.registry import callbacks

    callbacks.register("keyaudit_outlier_a", func=InjectOutlier)
    callbacks.register("keyaudit_outlier_b", func=InjectOutlier)
    tmp, name = tmp_path_factory.mktemp("keyaudit"), "keyaudit"
    cfg = tiny_config(tmp, tiny_data, {
        "variables": {"run_name": name}, "max_duration": f"{END}ba",
        "eval_interval": f"{END}ba", "save_interval": f"{END}ba", "console_log_interval": "1ba",
        "algorithms": {"te_swap": {"exclude": EXCLUDED}},
        "callbacks": {
            "fp8_stats": {"interval": INTERVAL, "image_interval": IMAGES, "dump_steps": [4]},
            "fp8_guard": {"consecutive": 2, "repromote_after": 2},
            # out_proj (3 % of the FLOPs) falls back at 4 and comes back at 8; up_proj (12.5 %)
            # is refused by the 10 % budget
            "keyaudit_outlier_a": {"layer": OUT_PROJ, "start": 2, "stop": 6},
            "keyaudit_outlier_b": {"layer": UP_PROJ, "start": 2}}}, wandb=True)
    del cfg["eval_loader"]
    (tmp / name).mkdir()
    console = io.StringIO()
    with contextlib.redirect_stderr(console):  # Composer's console logger takes it when built
        trainer = train(cfg)
        trainer.fit(duration=f"{MORE}ba")  # a second fit: its fit-end keys are `.ba<step>`
        trainer.close()
    folder = run_folder(tmp, name)
    [wandb] = wandb_history.read_runs(folder, wait=120)
    jsonl: dict[str, dict[int, Any]] = {}
    for step, metrics in read_jsonl(folder / "metrics.jsonl"):
        for key, value in metrics.items():
            jsonl.setdefault(key, {})[step] = value
    series: dict[str, dict[int, Any]] = {}
    for row in wandb.rows:
        for key, value in row.items():
            series.setdefault(key, {})[row["_step"]] = value
    return {"jsonl": jsonl, "hparams": json.loads((folder / "hparams.json").read_text()),
            "wandb": series, "config": wandb.config, "wandb_run": wandb,
            "console": console.getvalue()}


def logged_keys(run: dict[str, Any]) -> dict[str, set[str]]:
    """{normalized key: the sinks it reached} for every key of ours (they begin with `fp8`)."""
    found: dict[str, set[str]] = {}
    for sink in ("jsonl", "hparams", "wandb", "config"):
        for key in run[sink]:
            if key.startswith("fp8"):
                found.setdefault(normalized(key), set()).add(sink)
    return found


def test_the_normalization_reads_the_docs_placeholders_and_real_keys_alike():
    assert normalized("fp8_underflow_pct/gradient/blocks.0.attn.Wqkv") == \
        normalized("fp8_<stat>/<tensor>/<layer>") == "fp8_<stat>/<tensor>/<layer>"
    assert normalized("fp8/fc1_weight/worst_cos_sim") == "fp8/<tensor>/worst_cos_sim"
    assert normalized("fp8/stats_summary.ba12") == "fp8/stats_summary.ba<step>"
    assert normalized("fp8/guard/in_fallback/blocks.1.attn.out_proj") == \
        "fp8/guard/in_fallback/<layer>"
    assert normalized("fp8_te_underflow_pct/activation/blocks.0.attn.Wqkv") == \
        normalized("fp8_te_<stat>/<tensor>/<layer>")
    assert normalized("fp8_initial_scale/weight/blocks.1.ffn.up_proj") == \
        "fp8_initial_scale/<tensor>/<layer>"
    assert normalized("fp8/guard/fallbacks") == "fp8/guard/fallbacks"


@pytest.mark.slow
@pytest.mark.parametrize("source", ["docstrings", "pages"])
def test_every_documented_key_is_logged(run, source):
    documented = docstring_keys() if source == "docstrings" else page_keys()
    logged = logged_keys(run)
    missing = {key: place for key, place in documented.items()
               if key not in logged and key not in NOT_IN_THIS_RUN}
    assert not missing, f"documented, never logged in a run with every entry on: {missing}"
    assert not NOT_IN_THIS_RUN.keys() & logged.keys()  # the list is not stale


def test_the_keys_this_run_cannot_log_are_documented():
    documented = {**docstring_keys(), **page_keys()}
    assert not NOT_IN_THIS_RUN.keys() - documented.keys()


@pytest.mark.slow
@pytest.mark.parametrize("source", ["docstrings", "pages"])
def test_every_logged_key_is_documented(run, source):
    documented = docstring_keys() if source == "docstrings" else page_keys()
    undocumented = {key: sorted(sinks) for key, sinks in logged_keys(run).items()
                    if key not in documented}
    assert not undocumented, f"logged, not in the {source}: {undocumented}"


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@pytest.mark.slow
def test_every_series_lands_as_a_number_at_its_steps_in_the_jsonl_and_wandb(run):
    wandb = run["wandb_run"]
    steps = [row["_step"] for row in wandb.rows]
    assert steps == sorted(steps) and wandb.complete
    assert wandb_history.dropped_steps(wandb.path) == []
    assert sorted(wandb.steps("loss/train/total")) == list(range(END + MORE))
    series = {key: steps for key, steps in run["jsonl"].items() if key.startswith("fp8")}
    for key, values in series.items():
        assert all(_number(v) for v in values.values()), (key, values)
        assert run["wandb"].get(key, {}).keys() == values.keys(), key
        assert all(_number(v) for v in run["wandb"][key].values()), key
        assert set(values) <= set(STEPS), (key, sorted(values))
    by_kind: dict[str, set[int]] = {}
    for key, values in series.items():
        by_kind.setdefault(normalized(key), set()).update(values)
    every = {"fp8/flagged_layers", "fp8/guard/fallback_layers", "fp8/guard/fp8_flops_share",
             "fp8_<stat>/<tensor>/<layer>", "fp8_high_precision/<tensor>/<layer>",
             *(f"fp8/<tensor>/{name}" for name in SUMMARIES)}
    assert {kind for kind in every if by_kind.get(kind) != set(STEPS)} == set()
    # delayed scaling's first cast is step 0; markers are 1 where logged
    assert by_kind["fp8_initial_scale/<tensor>/<layer>"] == {0}
    for key, values in series.items():
        if (parsed := parse_key(key)) is not None and parsed[0] in MARKERS:
            assert set(values.values()) == {1.0}, key
    # fp8_stats' statistics, each for every watched layer and tensor, as the page lists them
    stats = {parsed[0] for key in series if (parsed := parse_key(key)) and
             parsed[0] not in MARKERS}
    assert stats == set(STAT_KEYS)
    # the guard's span series: 1 from its fallback's logging step, 0 from the re-promotion's
    assert run["jsonl"][f"fp8/guard/in_fallback/{OUT_PROJ}"] == {
        4: 1.0, 6: 1.0, 8: 0.0, 10: 0.0}


@pytest.mark.slow
def test_the_hyperparameters_are_the_same_everywhere_and_of_the_documented_kind(run):
    params = {k: v for k, v in run["hparams"].items() if k.startswith("fp8")}
    assert params == {k: v for k, v in run["config"].items() if k.startswith("fp8")}
    assert params["fp8/backend"] in {"te", "emulate"}
    assert isinstance(params["fp8/recipe"], dict) and params["fp8/recipe"]["scaling"] == "delayed"
    assert isinstance(params["fp8/modules_converted"], int)
    for share in ("fp8/linear_flops_share", "fp8/linear_param_share"):
        assert isinstance(params[share], float) and 0 < params[share] < 1
    assert isinstance(params["fp8_lint/findings"], int)
    assert set(params["fp8/layers"]) == {"parts", "layers"}
    for text in ("fp8/coverage", "fp8/dump_folder", "fp8/stats_summary", "fp8/guard/fallbacks",
                 f"fp8/stats_summary.ba{END + MORE}", f"fp8/guard/fallbacks.ba{END + MORE}"):
        assert isinstance(params[text], str) and params[text], text
    assert set(params[f"fp8/guard/fallback/{OUT_PROJ}"]) == {
        "layer", "step", "flops_share", "flagged", "reasons", "numbers"}
    assert set(params[f"fp8/guard/refused/{UP_PROJ}"]) == {
        "layer", "step", "flops_share", "fallback_share", "max_fallback_share"}
    record = params[f"fp8/guard/repromotion/{OUT_PROJ}"]
    assert {record["step"], record["layer"]} == {8, OUT_PROJ}
    assert all(_number(v) or isinstance(v, str) for v in record["numbers"].values())


def _row(page: str, what: str) -> str:
    """The row of `page`'s key table that begins with `| what |`."""
    return next(line for line in (REPO / page).read_text().splitlines()
                if line.startswith(f"| {what} |"))


@pytest.mark.slow
def test_the_pictures_are_where_and_when_the_page_says(run):
    heatmaps = {key.removeprefix("fp8_heatmap/"): sorted(steps)
                for key, steps in run["wandb"].items() if key.startswith("fp8_heatmap/")}
    # each multiple of IMAGES, and a fit's end where its last logging step was not shown yet
    # (the first fit's last, 8, was)
    image_steps = [4, 8, END + MORE]
    assert {stat: steps for stat, steps in heatmaps.items() if steps != image_steps} == {}
    assert sorted(run["wandb"]["fp8_table"]) == image_steps
    for step, shows in zip(image_steps, [4, 8, END], strict=True):  # the fit end's: the last
        columns, rows = run["wandb_run"].table("fp8_table", step)  # logging step's, 10
        assert columns[:4] == ["step", "layer", "tensor", "numbers"] and columns[-1] == "flags"
        assert {row[0] for row in rows} == {shows}, step
        numbers = {row[1]: row[3] for row in rows}
        assert set(numbers.values()) <= {"FP8", "what-if", "what-if (fp8_guard fallback)"}
        assert numbers[EXCLUDED] == "what-if"
    # the heatmap row names the statistics drawn, a row naming none promises every statistic;
    # NaN/Inf counts are drawn once one is seen (`health.history.shown`), none in this run
    row = _row("docs/fp8_stats.md", "heatmaps")
    named = set(re.findall(r"`([a-z_]+)`", row)) & set(STAT_KEYS)
    unseen = {stat for stat in ("nan_count", "inf_count") if not any(
        value for key, values in run["jsonl"].items()
        if (parsed := parse_key(key)) and parsed[0] == stat for value in values.values())}
    promised = named - unseen if named else set(STAT_KEYS)
    assert promised == set(heatmaps), (
        f"docs/fp8_stats.md heatmaps row promises fp8_heatmap/<stat> for {sorted(promised)}; "
        f"W&B got {sorted(heatmaps)}")


@pytest.mark.slow
def test_the_page_says_where_the_pictures_do_not_go(run):
    """Pictures go through `Logger.log_images`/`log_table`, which the jsonl logger (ours,
    registered as a logger) does not write: a page whose "where" says every logger must say
    so."""
    assert not any(k.startswith(("fp8_heatmap", "fp8_table")) for k in run["jsonl"])
    for what in ("heatmaps", "per-layer table"):
        where = _row("docs/fp8_stats.md", what).split(" | ")[2]
        assert "jsonl" in where, f"docs/fp8_stats.md {what} row: {where!r}, but metrics.jsonl " \
                                 "holds none"


@pytest.mark.slow
def test_the_console_shows_the_summary_and_guard_series_only(run):
    shown = {normalized(key) for key in re.findall(r"Train (fp8\S*):", run["console"])}
    assert shown == {"fp8/flagged_layers", "fp8/guard/fallback_layers",
                     "fp8/guard/fp8_flops_share",
                     *(f"fp8/<tensor>/{name}" for name in SUMMARIES)}

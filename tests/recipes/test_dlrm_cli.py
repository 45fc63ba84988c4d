"""The DLRM recipe as a newcomer meets it: --help gives every flag a default, bad values end in an argparse error
naming the flag before any work, progress has totals, and the printed summary says what the JSON says."""
import json
import math
import re

import pytest

pytest.importorskip("torchmetrics")
pytest.importorskip("tqdm")

from cachedemb.recipes.dlrm import cli, report  # noqa: E402
from cachedemb.recipes.dlrm import main as dlrm_main  # noqa: E402
from cachedemb.recipes.dlrm.configs import DATA_PRESET, PRESETS  # noqa: E402
from cachedemb.recipes.dlrm.data import count_lines, preprocess_criteo_kaggle, synthetic_criteo  # noqa: E402
from cachedemb.recipes.dlrm.data import write_criteo_tsv  # noqa: E402

TINY = ["--synthetic-samples", "6000", "--embedding-dim", "4", "--batch-size", "512", "--limit-batches", "4",
        "--eval-batches", "2", "--device", "cpu", "--workers", "1"]
PRESET_FLAGS = {"--cache-ratio": "cache_ratio", "--embedding-dim": "embedding_dim", "--batch-size": "batch_size",
                "--epochs": "epochs", "--optimizer": "optimizer", "--lr": "lr", "--dense-lr": "dense_lr",
                "--interaction": "interaction", "--lr-warmup-steps": "lr_warmup_steps"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("synthetic_cli"))


def _help_blocks(text: str) -> dict[str, str]:
    """--help text -> {first option string: its help block}."""
    blocks, current = {}, None
    for line in text.splitlines():
        m = re.match(r"  (-{1,2}[\w-]+)", line)
        if m:
            current = m.group(1)
            blocks[current] = line
        elif current is not None and line.startswith("      "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


def test_help_lists_every_flag_with_its_default(capsys):
    with pytest.raises(SystemExit) as done:
        dlrm_main.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    blocks = _help_blocks(out)
    actions = [a for a in cli.build_parser()._actions if a.help != "==SUPPRESS==" and a.dest != "help"]
    assert len(actions) > 30
    for action in actions:
        flag = action.option_strings[0]
        assert flag in blocks, flag
        text = re.sub(r"\s+", " ", blocks[flag])
        assert "default" in text, (flag, text)
        if action.default not in (None, False):  # the parser's own default is the one shown
            assert f"default: {action.default}" in text, (flag, text)
        if flag in PRESET_FLAGS:  # per --data: each preset's value, from the presets themselves
            field = PRESET_FLAGS[flag]
            values = {d: getattr(PRESETS[p], field) for d, p in DATA_PRESET.items()}
            if len(set(values.values())) == 1:
                assert f"default: {values['synthetic']}" in text, (flag, text)
            else:
                assert all(f"{d} {v}" in text for d, v in values.items()), (flag, text)
    assert "--synthetic-rows" not in out  # the deprecated alias works but is not offered
    assert "--synthetic-samples" in out and "example" in out


@pytest.mark.parametrize("flag, value, expected", [
    ("--cache-ratio", "2.0", "in (0, 1]"), ("--cache-ratio", "0", "in (0, 1]"), ("--cache-ratio", "nan", "in (0, 1]"),
    ("--epochs", "0", ">= 1"), ("--batch-size", "-3", ">= 1"), ("--synthetic-samples", "1.5", ">= 1"),
    ("--lr", "0", "> 0"), ("--dense-lr", "inf", "> 0"), ("--seed", "-1", ">= 0"), ("--prefetch-depth", "x", ">= 0"),
    ("--cache-budget", "8XB", "byte size"), ("--host-cache-mb", "0", ">= 1"), ("--log-every", "0", ">= 1"),
])
def test_bad_value_exits_2_naming_flag_value_and_expectation(tmp_path, capsys, flag, value, expected):
    with pytest.raises(SystemExit) as bad:
        dlrm_main.main(["--data-dir", str(tmp_path), flag, value])
    assert bad.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and f"error: argument {flag}: expected" in err, err
    assert repr(value) in err and expected in err, err
    assert not any(tmp_path.iterdir())  # refused before any data was generated


@pytest.mark.parametrize("argv, words", [
    (["--prefetch-depth", "4", "--prefetch-horizon", "2"], ["--prefetch-horizon", ">= --prefetch-depth (4)", "2"]),
    (["--resume"], ["--resume", "--checkpoint-dir"]),
    (["--checkpoint-every", "10"], ["--checkpoint-every", "--checkpoint-dir"]),
    (["--data", "avazu"], ["--data avazu", "--data-dir"]),
    (["--optimizer", "adamw"], ["--optimizer", "'adamw'", "rowwise_adagrad"]),
], ids=["horizon", "resume", "checkpoint_every", "data_dir", "choice"])
def test_contradicting_flags_exit_2(capsys, argv, words):
    with pytest.raises(SystemExit) as bad:
        dlrm_main.parse_args(argv)
    err = capsys.readouterr().err
    assert bad.value.code == 2 and "usage: " in err and all(w in err for w in words), err


def test_deprecated_synthetic_rows_still_works(capsys):
    old = dlrm_main.parse_args(["--synthetic-rows", "1234"])
    err = capsys.readouterr().err
    assert "--synthetic-rows is deprecated; use --synthetic-samples" in err
    new = dlrm_main.parse_args(["--synthetic-samples", "1234"])
    assert capsys.readouterr().err == ""
    assert old.synthetic_samples == new.synthetic_samples == 1234
    assert vars(old).keys() == vars(new).keys()
    with pytest.raises(SystemExit):  # and is checked like the new name
        dlrm_main.parse_args(["--synthetic-rows", "0"])
    assert "argument --synthetic-rows: expected a whole number >= 1, got '0'" in capsys.readouterr().err
    assert dlrm_main.parse_args([]).synthetic_samples == PRESETS["synthetic-demo"].synthetic_samples


def _summary_values(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(r"^  (AUC|logloss|accuracy|samples/s|hit rate|rows moved|"
                                                        r"time|metrics) +(\S+(?: \S+)*?)(?: {2,}|$)", text, re.M)}


def _seconds(text: str) -> float:
    m = re.fullmatch(r"([\d.]+) s", text)
    return float(m.group(1))


def test_summary_says_what_the_json_file_says(data_dir, tmp_path, capsys):
    path = tmp_path / "out" / "metrics.json"
    returned = dlrm_main.main(TINY + ["--data-dir", data_dir, "--log-every", "2", "--metrics-file", str(path)])
    captured = capsys.readouterr()
    saved = json.loads(path.read_text())
    assert saved == returned  # full precision in the file
    lines = captured.out.strip().splitlines()
    assert len(lines) <= 12 and all(len(line) <= 100 for line in lines[:-1]), captured.out  # short, no JSON
    assert lines[0].startswith("DLRM on synthetic: 1 epoch, 4 steps of 512 samples")
    got = _summary_values(captured.out)
    assert float(got["AUC"]) == pytest.approx(saved["auc"], abs=5e-5)
    assert float(got["logloss"]) == pytest.approx(saved["logloss"], abs=5e-5)
    assert float(got["accuracy"]) == pytest.approx(saved["accuracy"], abs=5e-5)
    assert float(got["samples/s"].replace(",", "")) == pytest.approx(saved["samples_per_s"], abs=0.5)
    assert float(got["hit rate"]) == pytest.approx(saved["cache_hit_rate"], abs=5e-4)
    assert int(got["rows moved"].replace(",", "")) == saved["cache_rows_in"] > 0
    assert _seconds(got["time"]) == pytest.approx(saved["train_time_s"], rel=0.01)
    assert got["metrics"] == str(path)
    # Not a terminal (pytest's capture): no bars, but a line per stage and per --log-every steps, with totals.
    err = captured.err
    assert "\r" not in err and "it/s" not in err
    assert re.search(r"^epoch 1/1  step 2/4 \(50%\)  loss [\d.]+  hit rate [\d.]+  [\d,]+ samples/s  eta ",
                     err, re.M), err
    assert re.search(r"^epoch 1/1: 4 steps in ", err, re.M), err
    # the rows moved are the cache's own counter (independent of the hit-rate arithmetic)
    assert saved["train_samples"] == 4 * 512 and saved["steps"] == 4


def test_metrics_file_dash_prints_json_on_stdout_and_quiet_silences_progress(data_dir, capsys):
    returned = dlrm_main.main(TINY + ["--data-dir", data_dir, "--quiet", "--metrics-file", "-"])
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1]) == returned  # one JSON line, full precision
    assert len(captured.out.strip().splitlines()) == 1
    assert captured.err.startswith("DLRM on synthetic")  # the summary moved to stderr; no progress lines
    assert not re.search(r"^(epoch|data:|eval)", captured.err, re.M), captured.err


def test_hit_rate_prefers_the_cache_own_figure():
    assert report.hit_rate({"hit_rate": 0.25, "rows_in": 1, "unique": 4}) == 0.25
    assert report.hit_rate({"rows_in": 3, "unique": 4}) == 0.25  # fallback: 1 - rows moved / distinct ids
    assert math.isnan(report.hit_rate({"rows_in": 0, "unique": 0}))
    assert dlrm_main.hit_rate is report.hit_rate


def test_summary_of_a_run_stopped_early_and_of_nan():
    metrics = {"data": "synthetic", "epochs": 2, "steps": 8, "batch_size": 512, "cache_ratio": 0.01,
               "device": "cpu", "world_size": 2, "samples_per_s": float("nan"), "train_samples": 0,
               "cache_hit_rate": float("nan"), "cache_rows_in": 0, "train_time_s": 0.0}
    text = report.format_summary(metrics)
    assert "on 2 ranks" in text and "not evaluated: stopped after step 8" in text and "nan" not in text.lower()
    assert json.loads(report.to_json(metrics))["cache_hit_rate"] is None  # strict JSON


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_progress_reaches_each_stage_total(tmp_path, workers):
    config = synthetic_criteo(scale=1 / 4000, min_large=500)
    calls = []
    write_criteo_tsv(tmp_path / "train.txt", 70_000, config.table_sizes, progress=lambda *a: calls.append(a))
    assert calls == [("generating", n, 70_000, "samples") for n in (0, 32768, 65536, 70_000)]  # start, blocks
    calls.clear()
    preprocess_criteo_kaggle(tmp_path / "train.txt", tmp_path / "pre", config=config, workers=workers,
                             split_bytes=4 << 20, progress=lambda *a: calls.append(a))
    last = {}
    for stage, done, total, unit in calls:
        assert 0 <= done <= total and done >= last.get(stage, (0,))[0], calls
        last[stage] = (done, total, unit)
    size = (tmp_path / "train.txt").stat().st_size
    assert last["counting lines"] == (size, size, "B")
    assert last["parsing"] == (count_lines(tmp_path / "train.txt"),) * 2 + ("samples",)
    assert ("counting ids" in last) == (workers > 1)
    if workers > 1:
        assert last["counting ids"] == (config.num_cat, config.num_cat, "tables")
    stages = [s for k, (s, *_) in enumerate(calls) if k == 0 or calls[k - 1][0] != s]
    assert stages == list(last)  # each stage reported in one run, in order

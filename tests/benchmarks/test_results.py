"""The committed benchmark runs hold the keys their issues name.

`notebooks/04_performance.ipynb` plots these files; this checks they are
there and complete, so the notebook's plots run in CI. The runs on one GPU
(`results/h100/`, benchmarks/README.md) are checked alike.
"""

import json
import pathlib

import pytest

from jaxlod.ops import default_plan

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"
RNN_MODE_KEYS = {
  "jaxlod_s",
  "flax_capacity_s",
  "flax_exact_s",
  "floor_s",
  "torch_packed_s",
  "speedup_vs_flax_capacity",
  "speedup_vs_flax_exact",
  "ratio_to_floor",
  "speedup_vs_torch",
  "phased_scans_s",
  "ratio_to_phased_scans",
  "phased_scans_ratio_to_floor",
}


# The folders under results/ of runs on a GPU, beside the CPU runs ("").
GPU_FOLDERS = ("h100",)
FOLDERS = pytest.mark.parametrize("folder", ("", *GPU_FOLDERS))


def _load(name: str, folder: str = "") -> dict:
  path = RESULTS / folder / f"{name}.json"
  if not path.is_file():
    pytest.fail(
      f"{path} is missing: run `python -m benchmarks.{name} --json "
      f"{path.relative_to(RESULTS.parents[1])}`."
    )
  report = json.loads(path.read_text())
  if folder in GPU_FOLDERS:
    assert report["machine"]["backend"] == "gpu", path
  return report


@FOLDERS
def test_rnn_results_have_every_workload_and_key(folder):
  rnn = _load("rnn", folder)
  assert {"cpu_count", "load_average_at_start"} <= set(rnn["machine"])
  if folder in GPU_FOLDERS:  # torch's arm ran on the GPU too (cuDNN).
    assert rnn["machine"]["torch_device"] == rnn["machine"]["device_kind"]
  assert set(rnn["workloads"]) == {"W1", "W2", "W3"}
  for name, workload in rnn["workloads"].items():
    for mode in ("train", "forward"):
      assert set(workload[mode]) >= RNN_MODE_KEYS, (name, mode)
      times = workload[mode]
      assert times["speedup_vs_flax_capacity"] == pytest.approx(
        times["flax_capacity_s"] / times["jaxlod_s"]
      )
      assert times["ratio_to_floor"] == pytest.approx(
        times["jaxlod_s"] / times["floor_s"]
      )
      assert times["ratio_to_phased_scans"] == pytest.approx(
        times["jaxlod_s"] / times["phased_scans_s"]
      )
    assert "jaxlod_train_fixed_capacity_100_batches" in workload["compiles"]


@FOLDERS
def test_attention_results(folder):
  attention = _load("attention", folder)
  for arm in ("jaxlod", "padded_expansion"):
    assert {"temp_bytes", "peak_rss_bytes", "step_s"} <= set(attention[arm])
  assert attention["memory_ratio"] == pytest.approx(
    attention["padded_expansion"]["temp_bytes"] / attention["jaxlod"]["temp_bytes"]
  )


@FOLDERS
def test_decode_results(folder):
  decode = _load("decode", folder)
  assert {"jaxlod_s", "batchwide_s", "speedup", "identical"} <= set(decode)
  assert decode["speedup"] == pytest.approx(decode["batchwide_s"] / decode["jaxlod_s"])
  assert isinstance(decode["identical"], bool)


@FOLDERS
def test_g2p_options_results(folder):
  options = _load("g2p_options", folder)
  train, decode = options["train_step"], options["decode"]
  assert train["ratio"] == pytest.approx(
    train["host_tables_s"] / train["device_ranks_s"]
  )
  assert decode["ratio"] == pytest.approx(
    decode["compaction_s"] / decode["batchwide_s"]
  )
  if folder in GPU_FOLDERS:
    # TF32 matrix products: the same token ids, scores apart by TF32's rounding.
    assert decode["ids_equal"] is True
    assert decode["score_max_abs_diff"] < 1e-3
  else:
    assert decode["identical"] is True
  # An option is on unless it measured slower (or, for compaction, changed
  # the hypotheses).
  limit = options["slower_than"]
  assert options["decision"]["host_tables"] == (train["paired_ratio"] <= limit)
  assert options["decision"]["compaction"] == (
    decode["paired_ratio"] <= limit and decode["identical"]
  )


@FOLDERS
def test_g2p_throughput_results(folder):
  report = _load("g2p_throughput", folder)
  assert {"cpu_count", "load_average_at_start"} <= set(report["machine"])
  arms = report["arms"]
  assert report["reference_arm"] in arms and len(arms) >= 2
  assert arms[report["reference_arm"]]["words_ratio"] == 1.0
  for arm in arms.values():
    assert {"parameters", "compile_s", "steps_per_s", "words_per_s"} <= set(arm)
    assert arm["words_per_s"] > arm["steps_per_s"] > 0


def test_g2p_members_results():
  report = _load("g2p_members")
  arms = report["arms"]
  one, apart = arms["one process"], arms["one process per core"]
  assert one["processes"] == 1
  assert apart["processes"] == len(report["cores"]) == len(apart["steps_per_s_each"])
  for arm in (one, apart):
    assert len(arm["per_round_together"]) == report["rounds"]
    assert arm["steps_per_s_together"] > 0
  # The ratio is the median of per-round ratios, so it lies within theirs.
  ratios = [
    a / o
    for a, o in zip(apart["per_round_together"], one["per_round_together"], strict=True)
  ]
  assert min(ratios) - 1e-2 <= report["ratio"] <= max(ratios) + 1e-2


def test_compile_results_hold_the_frontier():
  report = _load("compile")
  assert set(report["workloads"]) == {"W1", "W3"}
  for name, workload in report["workloads"].items():
    arms = workload["arms"]
    assert set(arms) == {
      "floor",
      "flax_capacity",
      "ladder_default",
      "ladder_pow2",
      "ladder_pow4",
      "ladder_two",
      "ladder_one",
      "lanes",
    }, name
    for arm in arms.values():
      assert arm["ratio_to_floor"] == pytest.approx(
        arm["step_s"] / arms["floor"]["step_s"]
      )
      assert arm["compile_s"] > 0
    assert len(arms["ladder_one"]["ladder"]) == 1
    # The lanes design computes the same loss (up to summation order).
    assert workload["lanes_loss_abs_diff"] <= 1e-6 * abs(workload["loss"])
    assert set(workload["step_cost"]) >= {"4", "8", "16", "32", "64"}
  cache = report["compilation_cache"]["W1_jaxlod_train"]
  assert cache["warm"]["first_call_s"] < cache["cold"]["first_call_s"]


def test_hoist_results_compare_equal_gradients():
  report = _load("hoist")
  assert set(report["workloads"]) == {"W1", "W2", "W3"}
  for name, workload in report["workloads"].items():
    times = workload["step_s"]
    assert set(times) == {"floor", "floor_hoisted", "jaxlod", "jaxlod_hoisted"}
    assert workload["jaxlod_hoisted_speedup"] == pytest.approx(
      times["jaxlod"] / times["jaxlod_hoisted"]
    ), name
    assert workload["max_abs_grad_diff"] < 1e-2, name


def test_scan_results():
  """benchmarks/scan.py's CPU run (issue 56): every arm on W1 and W3, the
  ratios consistent with the medians, one compilation, temporary bytes
  for the workload and for lengths ten times longer."""
  report = _load("scan")
  assert report["machine"]["backend"] == "cpu"
  assert set(report["workloads"]) == {"W1", "W3"}
  for workload in report["workloads"].values():
    arms = workload["arms"]
    assert set(arms) == {
      "linear_scan",
      "assoc_capacity",
      "assoc_longest",
      "scan_capacity",
      "dynamic_rnn",
    }
    base = arms["linear_scan"]["median_s"]
    for arm, speedup in workload["speedup"].items():
      assert speedup == pytest.approx(arms[arm]["median_s"] / base)
    assert max(workload["max_rel_diff"].values()) < 1e-4
    assert workload["compiles_over_100_batches"] == 1
    temp = workload["temp_bytes"]
    assert temp["ratio_x10"] == pytest.approx(temp["lengths_x10"] / temp["workload"])
  assert report["targets"] == {"W1_vs_assoc_capacity": 2.0, "vs_assoc_longest": 1.0}


def test_sequence_attention_results():
  """benchmarks/sequence_attention.py's CPU run (issue 65): every arm on W1,
  W2 and the long batch, the speed-ups consistent with the medians, the
  padded arms equal to jaxlod on the real rows, the cells, one compilation
  over 100 batches and the bound at Flax's cost per row and per cell."""
  report = _load("sequence_attention")
  assert report["machine"]["backend"] == "cpu"
  assert set(report["workloads"]) == {"W1", "W2", "long"}
  for workload in report["workloads"].values():
    times = workload["times"]
    for mode in ("forward", "train"):
      base = times[f"jaxlod_{mode}"]["median_s"]
      for arm in ("flax_longest", "flax_capacity"):
        speedup = workload[f"{mode}_speedup_{arm}"]
        assert speedup == pytest.approx(times[f"{arm}_{mode}"]["median_s"] / base)
    assert max(workload["max_abs_diff"].values()) < 1e-4
    real = workload["real_cells"]
    assert real == sum(n * n for n in workload["lengths"])
    for arm, cells in workload["cells"].items():
      assert workload["work_ratio"][arm] == pytest.approx(cells / real)
    assert workload["compiles_over_100_batches"] == 1
    layer = times["flax_longest_train"]["median_s"]
    attention = times["core_flax_longest_train"]["median_s"]
    rows = workload["workload"]["batch"] * workload["longest"]
    at_flax_cost = (layer - attention) * workload["real_tokens"] / rows
    at_flax_cost += attention * real / workload["cells"]["flax_longest"]
    bound = workload["train_speedup_bound_at_flax_cost"]
    assert bound == pytest.approx(layer / at_flax_cost)
  assert report["targets"]["work_ratio"] == 1.5


def test_attention_revisions_results():
  """benchmarks/attention_revisions.py's run: each revision's ratio is its
  median over the first's, its outputs and gradients equal the first's to
  float32's rounding, and each step's temporaries are recorded, for the
  attention alone and for the layer."""
  report = _load("attention_revisions")
  first, *_ = report["revisions"]
  assert set(report["workloads"]) == {"W1", "W2", "long"}
  for workload in report["workloads"].values():
    for mode in ("forward", "train", "layer_train"):
      medians = workload[mode]["median_s"]
      assert set(medians) == set(report["revisions"])
      for rev, ratio in workload[mode]["ratio"].items():
        assert ratio == pytest.approx(medians[rev] / medians[first])
      assert max(workload[mode]["max_abs_diff"].values()) < 1e-4
      temps = workload[mode]["temp_bytes"]
      assert set(temps) == set(report["revisions"]) and min(temps.values()) > 0


def test_sweep_results():
  """benchmarks/sweep.py's run: every cell's ratios are its medians', the
  fastest plan is the plan arm of the least median, every arm's results
  are Flax's, the drop-in ran the rule's plan, and the summary is the
  cells'; its picture is on the benchmarks page."""
  report = _load("sweep")
  cells = report["cells"]
  assert cells and not report["skipped"]
  for cell in cells:
    train, ideal = cell["train"], cell["ideal"]
    medians = train["median_s"]
    best = min(medians[k] for k in ("flax", "torch_padded") if k in medians)
    assert train["speedup_vs_best_padded"] == pytest.approx(best / medians["dropin"])
    assert train["fraction_of_ideal"] == pytest.approx(
      medians["flax"] / medians["dropin"] / ideal
    )
    plans = {k.removeprefix("plan_"): v for k, v in medians.items() if "plan_" in k}
    assert train["fastest_plan"] == min(plans, key=plans.get)
    assert cell["results_match"]
    # The drop-in arm ran the rule's plan for the cell's padded shape.
    rule = default_plan("cpu", sequences=cell["batch"], time=cell["time"])
    assert cell["dropin_plan"] == repr(rule)
  summary = report["summary"]["train"]
  assert summary["cells"] == len(cells)
  assert summary["worst_speedup_vs_best_padded"] == pytest.approx(
    min(c["train"]["speedup_vs_best_padded"] for c in cells)
  )
  picture = RESULTS.parents[1] / "docs" / "guide" / "sweep.png"
  assert picture.is_file() and picture.stat().st_size > 10_000


def test_tune_check_results():
  """benchmarks/tune_check.py's run: on each cell `tune_plan` picked the
  plan the committed sweep measured fastest, with the default's results."""
  report = _load("tune_check")
  assert len(report["cells"]) >= 3
  cells = report["cells"].values()
  for cell in cells:
    assert cell["agrees"] == (cell["picked"] == cell["sweep_fastest"])
    assert cell["max_rel_diff_vs_reference"] < 1e-4
  assert report["agree_everywhere"] == all(c["agrees"] for c in cells)

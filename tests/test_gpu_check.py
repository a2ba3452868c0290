"""scripts/gpu_check.sh: its dry run end to end on the CPU, and its report of a GPU run (rendered from
made-up results, since no GPU is at hand)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
TITLES = ["bf16 training on CUDA", "agent_devices:", "torchrun on GPUs", "FSDP2: sharded agents", "lean decoder == transformers on CUDA",
          "vLLM rollout backend", "throughput:"]


def load_runner():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def section_texts(report: str) -> list[str]:
    """The report's numbered sections, in order."""
    parts = re.split(r"\n(?=\[\d\] )", report.split("\n[setup]", 1)[1])[1:]
    return [re.sub(r"\ngpu_check: .*", "", part, flags=re.S) for part in parts]


@pytest.mark.slow
def test_dry_run_reports_every_step(tmp_path):
    report = tmp_path / "out" / "report.txt"
    env = {**os.environ, "COMLRL_GPU_CHECK_DIR": str(tmp_path / "work")}
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--python", sys.executable, "--report", str(report)],
                            capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = report.read_text()
    assert result.stdout.startswith(text.splitlines()[0])  # the same report on stdout
    assert text.startswith("==== comlrl GPU check: DRY RUN on the CPU")
    assert "\n[environment]\n  main " in text and "torch " in text
    setup = text.split("\n[setup]\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split()[0] for line in setup] == ["main", "vllm", "comlrl", "trl"]
    assert all("dry run: nothing installed" in line for line in setup)
    sections = section_texts(text)
    assert len(sections) == len(TITLES)
    for number, (section, title) in enumerate(zip(sections, TITLES), 1):
        assert section.startswith(f"[{number}] {title}"), section
    for section in sections[:6]:  # every CUDA step says why it did not run
        assert section.splitlines()[1].strip() == "skipped: no CUDA", section
        assert re.search(r"\(\d+ test\(s\)\)", section)
    bench = sections[6]
    assert "dry run: tiny model a" in bench
    ours = re.search(r"comlrl \(this tree\)\s+([\d.]+)\s+([\d.]+)\s+(\d+)", bench)
    assert ours and float(ours.group(1)) > 0
    assert bench.count("skipped: dry run installs no peers") == 2
    summary = re.search(r"^gpu_check: (\d+) passed, (\d+) failed, (\d+) skipped$", text, flags=re.M)
    assert summary and summary.groups() == ("1", "0", "22")
    data = json.loads(report.with_suffix(".json").read_text())
    assert data["mode"] == "dry-run" and data["summary"] == {"passed": 1, "failed": 0, "skipped": 22}
    assert [s["key"] for s in data["sections"]] == ["bf16", "agent_devices", "torchrun", "fsdp2", "lean_decoder",
                                                    "vllm", "throughput"]
    assert data["sections"][-1]["runs"]["comlrl (this tree)"]["device"] == "cpu"
    assert (tmp_path / "work" / "logs" / "junit-cuda.xml").is_file()


def test_gpu_report_from_results():
    """What a GPU run's report says, from made-up test results and benchmark numbers."""
    runner = load_runner()
    cases = [
        {"name": "test_bf16_autocast_training_on_cuda", "status": "passed", "seconds": 3.2, "detail": ""},
        {"name": "test_agent_devices_two_gpus_sample_concurrently", "status": "skipped", "seconds": 0,
         "detail": "needs 2 CUDA devices, this machine has 1"},
        {"name": "test_agent_devices_gpu_and_cpu", "status": "passed", "seconds": 1.0, "detail": ""},
        {"name": "test_torchrun_nccl_two_gpus_match_one_process", "status": "skipped", "seconds": 0,
         "detail": "needs 2 CUDA devices, this machine has 1"},
        {"name": "test_fsdp2_over_nccl_matches_one_unsharded_process", "status": "skipped", "seconds": 0,
         "detail": "needs 2 CUDA devices, this machine has 1"},
        {"name": "test_lean_decoder_sampled_tokens_equal_transformers_on_cuda[qwen2-gqa]", "status": "failed",
         "seconds": 0.5, "detail": "AssertionError: assert False"},
        {"name": "test_something_new", "status": "passed", "seconds": 0.1, "detail": ""},
    ]
    groups = runner.split_groups(cases, ["bf16", "agent_devices", "torchrun", "fsdp2", "lean_decoder"])
    sections = [runner.group_section(key, title, groups[key]) for key, title, _ in runner.GROUPS[:-1]]
    sections.append(runner.group_section("other", "other CUDA tests", groups["other"]))
    sections.append(runner.group_section("vllm", "vLLM", [], skipped="--skip vllm"))
    ours = {"status": "passed", "seconds_per_epoch": 2.0, "env_steps_per_s": 32.0, "generated_tokens_per_s": 900.0,
            "peak_rss_mb": 3000.0, "peak_gpu_mb": 8000.0, "phase_seconds_per_epoch": {"rollout": 1.5, "update": 0.4}}
    peer = {"status": "passed", "seconds_per_epoch": 6.0, "env_steps_per_s": 10.7, "generated_tokens_per_s": None,
            "peak_rss_mb": 3500.0, "peak_gpu_mb": 9000.0}
    sections.append({"key": "throughput", "title": "throughput", "status": "passed (some skipped)", "what": "model d",
                     "model": "Qwen2.5-0.5B shape", "runs": {"comlrl (this tree)": ours, "comlrl 1.4.3": peer,
                                                             "TRL GRPO (1 policy)": {"status": "skipped: no trl"}},
                     "speedups": {"comlrl 1.4.3": 3.0}})
    report = {"mode_line": "1 x NVIDIA H200 (140 GiB)", "date": "d", "host": "h", "commit": "c", "setup": [],
              "environment": {"nvidia_smi": "NVIDIA H200, 580.1, 143771 MiB", "interpreters": {"main": {
                  "python": "py", "python_version": "3.12", "torch": "2.11.0", "torch_cuda": "13.0", "nccl": "2.27.7",
                  "gpus": ["NVIDIA H200 (140 GiB)"], "transformers": "5.17.0"}}},
              "sections": sections, "summary": runner.summarize(sections), "report_path": "r", "workdir": "w"}
    assert report["summary"] == {"passed": 5, "failed": 1, "skipped": 5}
    text = runner.render(report)
    two_gpus = "skipped: needs 2 CUDA devices, this machine has 1"
    assert [s["status"] for s in sections[:5]] == ["passed", "passed (some skipped)", two_gpus, two_gpus, "failed"]
    assert "    FAIL  test_lean_decoder_sampled_tokens_equal_transformers_on_cuda[qwen2-gqa]: AssertionError" in text
    assert "    PASS  test_bf16_autocast_training_on_cuda (3.2 s)" in text
    assert "    skip  test_agent_devices_two_gpus_sample_concurrently: needs 2 CUDA devices" in text
    assert "[6] other CUDA tests" in text and "[7] vLLM\n    skipped: --skip vllm" in text
    assert re.search(r"comlrl 1\.4\.3\s+6\.000\s+10\.7\s+n/a\s+9000\s+3500\s+3\.00x", text)
    assert "TRL GRPO (1 policy)    skipped: no trl" in text
    assert "torch 2.11.0 (CUDA 13.0, NCCL 2.27.7); NVIDIA H200 (140 GiB)" in text
    assert text.rstrip().endswith("logs in w)") and "\ngpu_check: 5 passed, 1 failed, 5 skipped\n" in text


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: the script would install")
def test_without_cuda_the_real_check_refuses_and_points_to_the_dry_run(tmp_path):
    env = {**os.environ, "COMLRL_GPU_CHECK_DIR": str(tmp_path)}
    result = subprocess.run(["bash", str(SCRIPT), "--python", sys.executable], capture_output=True, text=True,
                            timeout=300, env=env)
    if result.returncode == 0:  # pragma: no cover - only where the interpreter's torch sees CUDA
        pytest.skip("this interpreter has CUDA")
    assert result.returncode == 2 and "--dry-run" in result.stderr


def test_qwen2_model_dir_builds_the_shape_it_is_given(tmp_path):
    """comlrl.testing.qwen2_model_dir: the benchmark's model d (Qwen2.5-0.5B's shape) and the vLLM
    tests' tiny model (head size 64, untied head)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from comlrl.testing import QWEN2_5_0_5B_SHAPE, qwen2_model_dir

    with torch.device("meta"):  # no memory: count model d's parameters
        d = Qwen2ForCausalLM(Qwen2Config(**QWEN2_5_0_5B_SHAPE, vocab_size=151936))
    assert sum(p.numel() for p in d.parameters()) == 494_032_768
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False)
    path = qwen2_model_dir(shape, cache_dir=tmp_path)
    assert qwen2_model_dir(shape, cache_dir=tmp_path) == path  # built once, then reused
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.hidden_size // model.config.num_attention_heads == 64
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.config.vocab_size == len(tokenizer) == 512 and model.config.eos_token_id == tokenizer.eos_token_id
    with pytest.raises(ValueError, match="vocab"):
        qwen2_model_dir(shape, vocab="gpt2", cache_dir=tmp_path)


def test_gpu_report_shows_the_mixed_precision_run_and_its_lead():
    """The throughput section with our mixed_precision='bf16' run (issue 32): its row, and its lead
    over each peer's bf16 run, computed as run_bench does."""
    runner = load_runner()
    run = {"status": "passed", "seconds_per_epoch": 2.0, "env_steps_per_s": 32.0, "generated_tokens_per_s": 900.0,
           "peak_rss_mb": 3000.0, "peak_gpu_mb": 8000.0}
    section = {"key": "throughput", "title": "throughput", "status": "passed", "what": "model d",
               "runs": {"comlrl (this tree)": run, runner.MIXED_RUN: {**run, "seconds_per_epoch": 2.5},
                        "comlrl 1.4.3": {**run, "seconds_per_epoch": 6.0}},
               "speedups": {"comlrl 1.4.3": 3.0}, "speedups_mixed": {"comlrl 1.4.3": 2.4}}
    text = "\n".join(runner.render_bench(section))
    assert "comlrl (this tree), mixed bf16    2.500" in text
    assert "ours with mixed_precision='bf16' vs comlrl 1.4.3:  2.40x" in text

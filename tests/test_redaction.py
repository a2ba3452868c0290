"""One rule for secrets, in every place a config is written or shown: to_dict, repr, exception
messages, checkpoints (config and fingerprints), W&B's config, MLflow's params, the comlrl train
record, a resume mismatch. Secrets by name at any depth (headers, extra body fields) and by shape."""

import json

import pytest

from comlrl import ConfigError, ResumeMismatchError
from comlrl._redact import REDACTED, is_secret_name, looks_secret, redact, redact_text
from comlrl.trainers.preference import MADPOIterConfig, MADPOIterTrainer

from helpers import SEED_PROMPTS, length_ratio_reward

HEADER_SECRET = "hdr-" + "1" * 24
BODY_SECRET = "body-" + "2" * 24
NESTED_SECRET = "nest-" + "3" * 24
SHAPED_SECRET = "sk-live-" + "4" * 28
KEY = "key-" + "6" * 24
URL_SECRET = "urlkey" + "7" * 24
PLAIN_SECRET = "plain" + "8" * 24  # no shape: hidden only by where it is or by its (compound) name
SHAPES = ("glpat-" + "g" * 20, "ya29." + "y" * 30, "gsk_" + "q" * 40, "r8_" + "r" * 30, "pplx-" + "p" * 40)
COMPOUND = ("accesstoken", "authtoken", "apitoken", "secretkey", "privatekey", "sessionid")
SECRETS = (HEADER_SECRET, BODY_SECRET, NESTED_SECRET, SHAPED_SECRET, KEY, URL_SECRET, PLAIN_SECRET, *SHAPES)

SETTINGS = dict(
    comparator_api_headers={"X-Auth-Token": HEADER_SECRET, "Cookie": f"session={HEADER_SECRET}", "X-Trace": "visible",
                            "Proxy-Authorization": f"Basic {HEADER_SECRET}", "X-Authentication": PLAIN_SECRET},
    comparator_api_extra_body={"api_key": BODY_SECRET, "options": {"clientSecret": NESTED_SECRET, "seed": 7},
                               "note": f"Bearer {SHAPED_SECRET}", "user": SHAPED_SECRET, "max_tokens": 5,
                               "tenant": PLAIN_SECRET},
    comparator_api_url=f"https://judge.example/v1/compare?key={URL_SECRET}&api-version=2024",
    comparator_api_key=KEY)
# Elsewhere in what a run records (W&B's config sections): compound names and key shapes.
EXTRA_SECTION = {**{name: PLAIN_SECRET for name in COMPOUND}, **{f"note{i}": s for i, s in enumerate(SHAPES)}, "ok": 1}


def assert_clean(text: str, where: str = "") -> None:
    leaked = [s for s in SECRETS if s in text]
    assert not leaked, f"{where}: {leaked}"


@pytest.mark.parametrize("name, secret", [
    ("Authorization", True), ("Proxy-Authorization", True), ("Cookie", True), ("X-Api-Key", True), ("apiKey", True),
    ("access_token", True), ("clientSecret", True), ("db_password", True), ("comparator_api_key", True),
    ("comparator_api_key_env", False), ("comparator_api_key_header", False), ("comparator_api_key_prefix", False),
    ("max_new_tokens", False), ("max_tokens", False), ("tokenizer", False), ("author", False), ("X-Trace", False),
    *((name, True) for name in (*COMPOUND, "X-Authentication", "accessToken", "session_id_token", "X-Session-Id")),
    ("authored_by", False), ("session_name", False),
])
def test_secret_names(name, secret):
    assert is_secret_name(name) is secret


@pytest.mark.parametrize("text, secret", [
    ("Bearer abcdefghijklmnop1234", True), ("sk-ant-" + "a" * 30, True), ("ghp_" + "b" * 36, True),
    ("AKIAABCDEFGHIJKLMNOP", True), ("eyJhbGciOiJIUzI1.eyJzdWIiOiIxMjM0.SflKxwRJSMeKKF2QT4", True),
    ("https://user:pw@example.com/x", True), *((shape, True) for shape in SHAPES),
    ("Count each token carefully", False), ("https://example.com/generate", False), ("Bearer", False),
])
def test_secret_shapes(text, secret):
    assert looks_secret(text) is secret


def test_redact_hides_by_name_at_any_depth_and_by_shape():
    value = {"a": [{"password": "x" * 8}], "b": {"fine": 1, "token": {"deep": "y"}}, "c": "Bearer " + "z" * 20,
             "d": "plain"}
    assert redact(value) == {"a": [{"password": REDACTED}], "b": {"fine": 1, "token": REDACTED}, "c": REDACTED,
                             "d": "plain"}
    assert redact(value, drop=True) == {"a": [{}], "b": {"fine": 1}, "c": REDACTED, "d": "plain"}
    assert redact_text(f"got {KEY} and Bearer {'q' * 20}", [KEY]) == f"got {REDACTED} and {REDACTED}"


def test_to_dict_and_repr_show_no_secret():
    config = MADPOIterConfig(**SETTINGS)
    shown = config.to_dict()
    assert shown["comparator_api_key"] == REDACTED
    # every header's value, and every string of the extra body, is a secret (numbers stay: resume compares them)
    assert shown["comparator_api_headers"] == {"X-Auth-Token": REDACTED, "Cookie": REDACTED, "X-Trace": REDACTED,
                                               "Proxy-Authorization": REDACTED, "X-Authentication": REDACTED}
    assert shown["comparator_api_extra_body"] == {"api_key": REDACTED, "options": {"clientSecret": REDACTED, "seed": 7},
                                                  "note": REDACTED, "user": REDACTED, "max_tokens": 5,
                                                  "tenant": REDACTED}
    assert shown["comparator_api_url"] == f"https://judge.example/v1/compare?key={REDACTED}&api-version={REDACTED}"
    assert redact(EXTRA_SECTION) == {**{k: REDACTED for k in EXTRA_SECTION}, "ok": 1}
    assert config.comparator_api_headers["X-Auth-Token"] == HEADER_SECRET  # the live value is untouched
    for text in (repr(config), str(config), json.dumps(shown)):
        assert_clean(text)
    assert "comparator_api_key_env=None" in repr(config) and "max_new_tokens=256" in repr(config)


def test_config_errors_never_quote_a_secret():
    with pytest.raises(ConfigError) as caught:
        MADPOIterConfig(comparator_api_headers={"X-Auth-Token": HEADER_SECRET, "X-Count": 3})
    assert "comparator_api_headers must be a dict of header names to strings" in str(caught.value)
    assert_clean(str(caught.value))
    config = MADPOIterConfig()
    with pytest.raises(ConfigError) as caught:
        config.comparator_api_key = ""  # a check that quotes the value
    with pytest.raises(ConfigError) as caught:
        config.vllm_engine_kwargs = {"hf_token": KEY, 3: "bad key"}
    assert_clean(str(caught.value))


@pytest.fixture
def trained(model_path, tokenizer, tmp_path, monkeypatch):
    """An iterative run whose config carries every kind of secret (the comparator is the policy
    itself, so no endpoint is needed), logged to jsonl, W&B (offline), TensorBoard and MLflow."""
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)
    settings = dict(num_train_epochs=1, num_iterations=1, preference_num_candidates=2, preference_pairs_per_sample=1,
                    max_new_tokens=6, temperature=1.0, top_p=1.0, train_batch_size=2, eval_interval=0, logging_steps=1,
                    report_to=["jsonl", "wandb", "tensorboard", "mlflow"],
                    mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", **SETTINGS)
    trainer = MADPOIterTrainer(agent_model=str(model_path), tokenizer=tokenizer, reward_func=length_ratio_reward,
                               train_dataset=[{"prompt": p} for p in SEED_PROMPTS[:2]],
                               args=MADPOIterConfig(**settings),
                               wandb_config={"project": "p", "dir": str(tmp_path),
                                             "config_sections": {"extra": {"password": KEY, "ok": 1},
                                                                 "more": EXTRA_SECTION}})
    trainer.train(checkpoint_dir=tmp_path / "run")
    return trainer, tmp_path, settings


def test_no_file_of_a_run_and_no_tracker_holds_a_secret(trained):
    trainer, root, settings = trained
    state = json.loads((root / "run" / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["config"]["comparator_api_extra_body"]["api_key"] == REDACTED
    assert state["fingerprints"]["config"]["comparator_api_extra_body"]["options"]["clientSecret"] == REDACTED
    assert state["config"]["comparator_api_url"].endswith(f"?key={REDACTED}&api-version={REDACTED}")
    files = [p for p in root.rglob("*") if p.is_file() and p.name != "mlflow.db"]
    assert any("offline-run" in str(p) for p in files)  # W&B's own files are among them
    for path in files:
        assert_clean(path.read_bytes().decode("latin-1"), str(path))
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=settings["mlflow_tracking_uri"])
    run = client.get_run(trainer.tracker_identities["mlflow"]["run_id"])
    assert run.data.params["comparator_api_key"] == REDACTED
    assert_clean(json.dumps(run.data.params), "MLflow params")


def test_a_resume_mismatch_names_the_field_not_the_secret(trained, model_path, tokenizer):
    trainer, root, settings = trained
    changed = dict(settings, num_iterations=2,
                   comparator_api_extra_body={**SETTINGS["comparator_api_extra_body"], "max_tokens": 9})
    resumed = MADPOIterTrainer(agent_model=str(model_path), tokenizer=tokenizer, reward_func=length_ratio_reward,
                               train_dataset=[{"prompt": p} for p in SEED_PROMPTS[:2]],
                               args=MADPOIterConfig(**{**changed, "report_to": "none", "mlflow_tracking_uri": None}))
    with pytest.raises(ResumeMismatchError, match="config.comparator_api_extra_body.max_tokens: saved 5, now 9") as caught:
        resumed.train(resume_from_checkpoint=root / "run" / "checkpoint-1")
    assert_clean(str(caught.value))

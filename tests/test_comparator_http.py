"""The HTTP comparator against a hostile or broken endpoint: no redirect followed (the key never
reaches another address), a whole-request timeout however slowly the reply trickles, cut-off and
malformed replies retried, a size limit, an echoed key kept out of the error, completions clipped
to max_new_tokens, and a trainer that needs the key only to train."""

import json
import time

import pytest

from comlrl import ComparatorError, ConfigError
from comlrl.trainers.preference import MADPOIterConfig, MADPOIterTrainer
from comlrl.trainers.preference.comparators import ApiComparator

from comparator_server import CaptureServer, ComparatorServer
from helpers import SEED_PROMPTS, length_ratio_reward

SECRET = "sk-test-" + "5" * 28


@pytest.fixture
def server(model_path):
    with ComparatorServer(model_path) as running:
        yield running


@pytest.fixture
def comparator(server, monkeypatch):
    """make(**config) -> an ApiComparator for ``server`` with the key in COMPARATOR_KEY."""
    monkeypatch.setenv("COMPARATOR_KEY", SECRET)

    def make(**overrides):
        settings = dict(comparator_policy="api", comparator_api_url=server.url, comparator_api_key_env="COMPARATOR_KEY",
                        comparator_api_timeout=2.0, comparator_api_retries=0, max_new_tokens=6)
        settings.update(overrides)
        return ApiComparator(MADPOIterConfig(**settings))

    return make


def test_a_redirect_is_never_followed_and_the_key_never_leaves(server, comparator):
    with CaptureServer() as other:
        server.redirect_to, server.faults = other.url, ["redirect"]
        with pytest.raises(ComparatorError, match="redirected the request \\(HTTP 307\\) to .*/collect; comlrl never "
                                                  "follows redirects, which would carry the API key"):
            comparator(comparator_api_retries=2).candidates("Hello", 0, {}, 2)
        assert other.headers == []  # nothing, let alone the key, reached the other address
    assert len(server.requests) == 1  # a redirect is not retried: it would redirect again


def test_the_timeout_bounds_the_whole_request(server, comparator):
    """A server that sends its whole answer one byte at a time (status line included) never
    times out a single read; the request as a whole does."""
    server.faults, server.drip_seconds = ["drip"], 0.1
    start = time.monotonic()
    with pytest.raises(ComparatorError, match="failed 1 time.*no whole reply within 1 s"):
        comparator(comparator_api_timeout=1.0).candidates("Hello", 0, {}, 2)
    assert time.monotonic() - start < 4.0  # the reply would take ~15 s


@pytest.mark.parametrize("fault, words", [
    ("truncated", "RemoteProtocolError"),
    ("bad_status", "RemoteProtocolError"),
    ("not_json", "the reply is not JSON"),
    ("stall", "no whole reply within"),
])
def test_cut_off_and_malformed_replies_are_retried(server, comparator, fault, words):
    if fault == "stall":
        server.stall_next, server.stall_seconds = 1, 2.5
    else:
        server.faults = [fault]
    with pytest.raises(ComparatorError, match=f"failed 1 time.*{words}"):
        comparator(comparator_api_timeout=1.5).candidates("Hello", 0, {}, 2)
    server.faults = [fault] if fault != "stall" else []
    server.stall_next = 1 if fault == "stall" else 0
    assert len(comparator(comparator_api_timeout=1.5, comparator_api_retries=1).candidates("Hello", 0, {}, 2)) == 2


def test_a_reply_beyond_the_size_limit_is_refused(server, comparator):
    server.faults, server.huge_bytes = ["huge"], 64 * 1024
    with pytest.raises(ComparatorError, match="beyond comparator_api_max_response_bytes=4096"):
        comparator(comparator_api_max_response_bytes=4096, comparator_api_retries=2).candidates("Hello", 0, {}, 2)
    assert len(server.requests) == 1


def test_a_server_that_echoes_the_key_never_puts_it_in_the_error(server, comparator):
    server.faults = ["echo"]
    headers = {"X-Session-Token": "tok-" + "9" * 20, "X-Trace": "visible"}
    with pytest.raises(ComparatorError) as caught:
        comparator(comparator_api_headers=headers).candidates("Hello", 0, {}, 2)
    message = str(caught.value)
    # every header's value is a secret (issue 29): even X-Trace's is never echoed into an error
    assert "HTTP 401" in message and '"X-Trace": "<redacted>"' in message and "visible" not in message
    assert SECRET not in message and "9" * 20 not in message
    assert server.headers[0]["Authorization"] == f"Bearer {SECRET}"  # the endpoint itself got the key


@pytest.mark.parametrize("url, words", [
    ("ftp://host/x", "http:// or https:// URL"),
    ("http:///nohost", "http:// or https:// URL"),
    ("https://user:pw@host/x", "must not hold credentials"),
])
def test_the_url_is_checked_when_the_config_is_built(url, words):
    with pytest.raises(ConfigError, match=words) as caught:
        MADPOIterConfig(comparator_policy="api", comparator_api_url=url)
    assert "pw@" not in str(caught.value)


def _trainer(model_path, tokenizer, **settings):
    args = dict(num_train_epochs=1, num_iterations=1, preference_num_candidates=2, preference_pairs_per_sample=2,
                max_new_tokens=6, temperature=1.0, top_p=1.0, train_batch_size=2, eval_interval=0, logging_steps=1)
    args.update(settings)
    return MADPOIterTrainer(agent_model=str(model_path), tokenizer=tokenizer, reward_func=length_ratio_reward,
                            train_dataset=[{"prompt": p} for p in SEED_PROMPTS[:2]], args=MADPOIterConfig(**args))


def test_api_completions_are_clipped_to_max_new_tokens(server, model_path, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("COMPARATOR_KEY", SECRET)
    server.faults = ["long"] * 100  # 400 words each, whatever max_new_tokens says
    trainer = _trainer(model_path, tokenizer, comparator_policy="api", comparator_api_url=server.url,
                       comparator_api_key_env="COMPARATOR_KEY", output_dir=str(tmp_path / "out"))
    trainer.train(checkpoint_dir=tmp_path / "run")
    pairs = [json.loads(line) for line in (tmp_path / "run" / "preference_replay" / "iteration_0001.jsonl")
             .read_text().splitlines()]
    from_api = [t for p in pairs for t in p["winner_completions"] + p["loser_completions"] if t.startswith("w0")]
    assert from_api and all(t == "w0 w1 w2" for t in from_api)  # 6 tokens of 400 words


def test_the_key_is_needed_to_train_not_to_build_or_export(model_path, tokenizer, tmp_path, monkeypatch):
    monkeypatch.delenv("UNSET_COMPARATOR_KEY", raising=False)
    trainer = _trainer(model_path, tokenizer, comparator_policy="api", comparator_api_url="http://127.0.0.1:9/x",
                       comparator_api_key_env="UNSET_COMPARATOR_KEY")
    trainer.save_model(tmp_path / "exported")
    assert (tmp_path / "exported" / "agent_1" / "config.json").is_file()
    with pytest.raises(ConfigError, match="comparator_api_key_env='UNSET_COMPARATOR_KEY' names an environment"):
        trainer.train(checkpoint_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_retry_after_is_honoured_and_capped(server, comparator, monkeypatch):
    """A 429 asking for 2 s was retried after 0.5 s (issue 29); a huge Retry-After is capped."""
    import comlrl.trainers.preference.comparators as comparators

    server.faults, server.retry_after = ["busy"], "2"
    start = time.monotonic()
    assert len(comparator(comparator_api_retries=1).candidates("Hello", 0, {}, 2)) == 2
    assert time.monotonic() - start >= 2.0  # not the 0.5 s backoff
    monkeypatch.setattr(comparators, "RETRY_AFTER_CAP", 0.2)
    server.faults, server.retry_after = ["busy"], str(10**9)
    start = time.monotonic()
    assert len(comparator(comparator_api_retries=1).candidates("Hello", 0, {}, 2)) == 2
    assert time.monotonic() - start < 10.0


def test_completions_with_lone_surrogates_reach_the_tokenizer_as_valid_text(server, comparator, tokenizer):
    server.faults = ["surrogates"]
    got = comparator().candidates("Hello", 0, {}, 2)
    assert got == ["half \ufffd pair", "\ufffd alone"]
    assert all(tokenizer(text)["input_ids"] for text in got)  # a lone surrogate made the tokenizer raise

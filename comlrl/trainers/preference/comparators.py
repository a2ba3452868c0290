"""Comparators of the iterative preference trainers: who the current policy's candidates are
compared with.

* ``current`` (and ``current_copy``): the agents themselves, sampled from independent seeds;
* ``model``: other models (``comparator_model_name`` / ``comparator_agents``), frozen;
* ``history``: the agents as they were ``comparator_history_k`` iterations ago (saved policies);
* ``api``: an HTTP endpoint, in the ``generic`` JSON format (CoMLRL's) or OpenAI chat,
  Anthropic messages or OpenAI responses format, with timeouts, bounded retries with backoff,
  candidates batched up to ``comparator_api_max_n_per_request`` per request, and the key read from
  ``comparator_api_key_env``: never logged, saved or sent anywhere but the endpoint.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from typing import Any, Mapping, Optional, Sequence

from ...exceptions import ComparatorError, ConfigError

__all__ = ["ApiComparator", "ComparatorError", "jsonable"]

logger = logging.getLogger("comlrl")

_RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


def jsonable(value: Any) -> Any:
    """``value`` with everything JSON cannot hold turned into plain values or strings."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item"):
        try:
            return value.item()
        except (TypeError, ValueError):
            pass
    return str(value)


def _texts(items: Any) -> list[str]:
    out = []
    for item in items if isinstance(items, list) else [items]:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, Mapping):
            message = item.get("message")
            text = next((item[k] for k in ("text", "content", "completion", "response") if isinstance(item.get(k), str)),
                        message.get("content") if isinstance(message, Mapping) else None)
            if text is not None:
                out.append(text)
        elif item is not None:
            out.append(str(item))
    return out


class ApiComparator:
    """Candidates from an HTTP endpoint (see the module docstring). ``args`` is the iterative
    config; nothing of it but the URL and non-secret headers ever appears in an error message."""

    def __init__(self, args: Any):
        self.url, self.format = args.comparator_api_url, args.comparator_api_format
        self.model, self.timeout, self.retries = args.comparator_api_model, args.comparator_api_timeout, \
            args.comparator_api_retries
        self.max_n, self.field, self.extra = args.comparator_api_max_n_per_request, \
            args.comparator_api_response_field, dict(args.comparator_api_extra_body or {})
        self.sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                             top_k=args.top_k)
        self.headers = {"Content-Type": "application/json", **(args.comparator_api_headers or {})}
        key = args.comparator_api_key
        if key is None and args.comparator_api_key_env:
            key = os.environ.get(args.comparator_api_key_env)
            if key is None:
                raise ConfigError(f"comparator_api_key_env={args.comparator_api_key_env!r} names an environment "
                                  "variable that is not set; export it before training.")
        header, prefix = args.comparator_api_key_header, (args.comparator_api_key_prefix or "").strip()
        if self.format == "anthropic":
            self.headers.setdefault("anthropic-version", "2023-06-01")
            if header.lower() == "authorization":
                header, prefix = "x-api-key", ("" if prefix.lower() == "bearer" else prefix)
        self._key_header = (header, f"{prefix} {key}".strip()) if key else None

    # --- one prompt ------------------------------------------------------------------------------
    def candidates(self, prompt: str, agent: int, item: Mapping[str, Any], count: int) -> list[str]:
        """``count`` completions of ``prompt`` for agent ``agent`` (fewer only if the endpoint
        returns fewer in the generic format, which is said)."""
        out: list[str] = []
        per_request = 1 if self.format in ("anthropic", "openai_responses") else (self.max_n or count)
        while len(out) < count:
            n = min(per_request, count - len(out))
            got = self._texts_of(self._post(self._body(prompt, agent, item, n)))
            if not got:
                raise ComparatorError(f"the comparator API at {self.url} returned no completion for agent {agent} "
                                      f"({self.format} format, {n} asked).")
            out.extend(got if self.format in ("generic", "openai") else got[:1])
            if self.format == "generic" and len(got) < n:
                logger.warning("comlrl: the comparator API returned %d of %d completions; using them.", len(got), n)
                break
        return out[:count]

    def _body(self, prompt: str, agent: int, item: Mapping[str, Any], n: int) -> dict[str, Any]:
        s = self.sampling
        if self.format == "openai":
            body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "n": n,
                    "max_tokens": s["max_new_tokens"], "temperature": s["temperature"], "top_p": s["top_p"]}
        elif self.format == "anthropic":
            body = {"model": self.model, "max_tokens": s["max_new_tokens"],
                    "messages": [{"role": "user", "content": prompt}], "temperature": s["temperature"]}
        elif self.format == "openai_responses":
            body = {"model": self.model, "input": prompt, "max_output_tokens": s["max_new_tokens"]}
        else:
            body = {"prompt": prompt, "agent_idx": agent, "num_return_sequences": n,
                    "max_new_tokens": s["max_new_tokens"], "temperature": s["temperature"], "top_p": s["top_p"],
                    "top_k": s["top_k"], "batch_item": jsonable(item)}
            if self.model is not None:
                body["model"] = self.model
        body = {k: v for k, v in body.items() if v is not None or self.format == "generic"}
        return {**body, **self.extra}

    def _texts_of(self, response: Any) -> list[str]:
        if self.format == "openai":
            return [t for c in response.get("choices", []) for t in _texts([c])] if isinstance(response, dict) else []
        if self.format == "anthropic":
            blocks = response.get("content", []) if isinstance(response, dict) else []
            return [b["text"] for b in blocks if isinstance(b, dict) and b.get("type") == "text" and "text" in b][:1]
        if self.format == "openai_responses":
            outputs = response.get("output", []) if isinstance(response, dict) else []
            return [c["text"] for o in outputs if isinstance(o, dict) for c in o.get("content", [])
                    if isinstance(c, dict) and c.get("type") in ("output_text", "text") and "text" in c][:1]
        value: Any = response
        for part in self.field.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if value is None and isinstance(response, Mapping):
            value = next((response[k] for k in ("completions", "responses", "outputs", "choices") if response.get(k)),
                         None)
        return _texts(value) if value is not None else []

    def _post(self, body: dict[str, Any]) -> Any:
        """POST with up to ``retries`` retries (timeouts, connection errors, 408/429/5xx), waiting
        0.5 s, 1 s, 2 s, ... between tries."""
        data = json.dumps(body, allow_nan=False).encode("utf-8")
        headers = dict(self.headers)
        if self._key_header is not None:
            headers[self._key_header[0]] = self._key_header[1]
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 8.0))
            request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                    raw = reply.read().decode("utf-8")
            except urllib.error.HTTPError as exc:
                detail = exc.read()[:300].decode("utf-8", "replace") if hasattr(exc, "read") else ""
                last = f"HTTP {exc.code}: {detail}"
                if exc.code in _RETRY_STATUS:
                    continue
                raise ComparatorError(f"the comparator API at {self.url} refused the request ({last}).") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
                last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
                continue
            try:
                return json.loads(raw)
            except json.JSONDecodeError:
                raise ComparatorError(f"the comparator API at {self.url} answered with something that is not JSON: "
                                      f"{raw[:200]!r}") from None
        raise ComparatorError(f"the comparator API at {self.url} failed {self.retries + 1} time(s) (timeout "
                              f"{self.timeout:g} s each); last error: {last}. Nothing of this iteration was trained; "
                              "resume from the last checkpoint once the endpoint answers.")


def load_comparator_models(names: Sequence[str], model_config: Optional[Mapping[str, Any]], devices: Sequence[Any]
                           ) -> tuple[list[Any], list[Any]]:
    """Frozen comparator models (and their tokenizers) from names, one per agent."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ...engine.inputs import model_kwargs

    models, tokenizers, loaded = [], [], {}
    for name, device in zip(names, devices):
        if name not in loaded:
            try:
                model = AutoModelForCausalLM.from_pretrained(name, **model_kwargs(model_config))
                tok = AutoTokenizer.from_pretrained(name)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"could not load comparator model {name!r}: {exc}") from exc
            if tok.pad_token_id is None:
                tok.pad_token = tok.eos_token
            loaded[name] = (model.to(device).eval().requires_grad_(False), tok)
        models.append(loaded[name][0])
        tokenizers.append(loaded[name][1])
    return models, tokenizers

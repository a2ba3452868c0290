"""Comparators of the iterative preference trainers: who the current policy's candidates are
compared with.

* ``current`` (and ``current_copy``): the agents themselves, sampled from independent seeds;
* ``model``: other models (``comparator_model_name`` / ``comparator_agents``), frozen;
* ``history``: the agents as they were ``comparator_history_k`` iterations ago (saved policies);
* ``api``: an HTTP endpoint, in the ``generic`` JSON format (CoMLRL's) or OpenAI chat,
  Anthropic messages or OpenAI responses format, candidates batched up to
  ``comparator_api_max_n_per_request`` per request, and the key read from
  ``comparator_api_key_env`` when training starts: never logged, saved or sent anywhere but the
  endpoint. Requests go through httpx (the ``api`` extra): ``comparator_api_timeout`` bounds each
  whole try (connecting, sending, and the whole reply, however slowly it trickles in); redirects
  are never followed (they would carry the key to another address); a reply is read up to
  ``comparator_api_max_response_bytes``; timeouts, broken connections, malformed or cut-off
  replies and 408/409/425/429/5xx answers are retried with backoff; whatever the server echoes
  back, the key never appears in an error message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Mapping, Optional, Sequence, TypeVar

from ..._imports import install_hint
from ..._redact import redact_text, secrets_in
from ...exceptions import ComparatorError, ConfigError

__all__ = ["ApiComparator", "ComparatorError", "jsonable", "HTTP_EXTRA"]

logger = logging.getLogger("comlrl")

_RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
_DETAIL_BYTES = 2048  # of an error reply, quoted in the error
HTTP_EXTRA = install_hint("api")
T = TypeVar("T")


class _Retry(Exception):
    """A try that failed in a way a later try may not (timeouts, broken or malformed replies);
    ``after``: the seconds the server asked to wait (``Retry-After``), if it did."""

    def __init__(self, message: str, after: Optional[float] = None):
        super().__init__(message)
        self.after = after


RETRY_AFTER_CAP = 60.0  # the longest Retry-After honoured between two tries, in seconds


def _run(make: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion from synchronous code: here when this thread has no event
    loop, else (a notebook's running loop) on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="comlrl-comparator") as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


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


_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads pairs the valid ones: what is left is lone


def _valid_text(text: str) -> str:
    """``text`` as valid Unicode: JSON may spell lone surrogates (``"\\ud800"``), which no
    tokenizer can encode; each becomes U+FFFD, as undecodable bytes do."""
    return _SURROGATE.sub("\ufffd", text)


def _retry_after(value: Optional[str]) -> Optional[float]:
    """Seconds a ``Retry-After`` header asks for (a number of seconds or an HTTP date), or None."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        from email.utils import parsedate_to_datetime

        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None or when.tzinfo is None:
            return None
        seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if seconds == seconds else None  # NaN: no usable wait


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
    config; nothing of it but the URL and non-secret headers ever appears in an error message.
    The key is read by :meth:`check_key` (train() calls it before any work), not when the trainer
    is built: building one to export its agents needs no key."""

    def __init__(self, args: Any):
        self.url, self.format = args.comparator_api_url, args.comparator_api_format
        self.model, self.timeout, self.retries = args.comparator_api_model, args.comparator_api_timeout, \
            args.comparator_api_retries
        self.max_bytes = args.comparator_api_max_response_bytes
        self.max_n, self.field, self.extra = args.comparator_api_max_n_per_request, \
            args.comparator_api_response_field, dict(args.comparator_api_extra_body or {})
        self.sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                             top_k=args.top_k)
        self.headers = {"Content-Type": "application/json", **(args.comparator_api_headers or {})}
        self._key_given, self._key_env = args.comparator_api_key, args.comparator_api_key_env
        header, prefix = args.comparator_api_key_header, (args.comparator_api_key_prefix or "").strip()
        if self.format == "anthropic":
            self.headers.setdefault("anthropic-version", "2023-06-01")
            if header.lower() == "authorization":
                header, prefix = "x-api-key", ("" if prefix.lower() == "bearer" else prefix)
        self._key_name, self._key_prefix = header, prefix
        self._key_header: Optional[tuple[str, str]] = None
        self._checked = False

    def check_key(self) -> None:
        """Read the API key (``comparator_api_key``, else the variable ``comparator_api_key_env``
        names). Raises ConfigError when that variable is not set."""
        key = self._key_given
        if key is None and self._key_env:
            key = os.environ.get(self._key_env)
            if key is None:
                raise ConfigError(f"comparator_api_key_env={self._key_env!r} names an environment variable that is "
                                  "not set; export it before training.")
        self._key_header = (self._key_name, f"{self._key_prefix} {key}".strip()) if key else None
        self._checked = True

    def _secrets(self) -> list[str]:
        """What an error message must never show: the key (alone and as sent) and every secret of
        the headers and the extra body."""
        sent = self._key_header[1] if self._key_header else None
        key = sent[len(self._key_prefix):].strip() if sent else None
        return [s for s in (sent, key) if s] + secrets_in(self.headers, "headers") + secrets_in(self.extra, "extra_body")

    # --- one prompt ------------------------------------------------------------------------------
    def candidates(self, prompt: str, agent: int, item: Mapping[str, Any], count: int) -> list[str]:
        """``count`` completions of ``prompt`` for agent ``agent`` (fewer only if the endpoint
        returns fewer in the generic format, which is said)."""
        out: list[str] = []
        per_request = 1 if self.format in ("anthropic", "openai_responses") else (self.max_n or count)
        while len(out) < count:
            n = min(per_request, count - len(out))
            got = [_valid_text(t) for t in self._texts_of(self._post(self._body(prompt, agent, item, n)))]
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
        """POST with up to ``retries`` retries (see the module docstring), waiting 0.5 s, 1 s,
        2 s, ... between tries, or what a 429 / 503's ``Retry-After`` asks (at most
        :data:`RETRY_AFTER_CAP`); the parsed JSON reply."""
        if not self._checked:
            self.check_key()
        data = json.dumps(body, allow_nan=False).encode("utf-8")
        headers = dict(self.headers)
        if self._key_header is not None:
            headers[self._key_header[0]] = self._key_header[1]
        last, asked = "", None
        for attempt in range(self.retries + 1):
            if attempt:  # the backoff, or longer when the server said so (capped: a hostile reply cannot stall us)
                time.sleep(max(min(0.5 * 2 ** (attempt - 1), 8.0), min(asked or 0.0, RETRY_AFTER_CAP)))
            try:
                return self._attempt(data, headers)
            except _Retry as exc:
                last, asked = str(exc), exc.after
        raise ComparatorError(self._scrub(
            f"the comparator API at {self.url} failed {self.retries + 1} time(s) (timeout {self.timeout:g} s for each "
            f"whole request); last error: {last}. Nothing of this iteration was trained; resume from the last "
            "checkpoint once the endpoint answers."))

    def _scrub(self, text: str) -> str:
        return redact_text(text, self._secrets())

    def _attempt(self, data: bytes, headers: dict[str, str]) -> Any:
        """One try: the reply's JSON, or _Retry / ComparatorError."""
        import httpx

        try:
            raw = _run(lambda: asyncio.wait_for(self._exchange(data, headers), self.timeout))
        except asyncio.TimeoutError:
            raise _Retry(f"no whole reply within {self.timeout:g} s") from None
        except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
            raise ComparatorError(self._scrub(f"comparator_api_url {self.url!r} cannot be requested: {exc}")) from None
        except (httpx.TransportError, httpx.DecodingError) as exc:
            raise _Retry(self._scrub(f"{type(exc).__name__}: {exc}")) from None
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise _Retry(self._scrub(f"the reply is not JSON: {raw[:200]!r}")) from None

    async def _exchange(self, data: bytes, headers: dict[str, str]) -> bytes:
        """Send the request and read the whole reply (up to ``max_bytes``), never following a
        redirect. Error statuses raise (_Retry for transient ones)."""
        import httpx

        async with httpx.AsyncClient(timeout=self.timeout, follow_redirects=False) as client:
            async with client.stream("POST", self.url, content=data, headers=headers) as reply:
                if reply.is_redirect:
                    raise ComparatorError(self._scrub(
                        f"the comparator API at {self.url} redirected the request (HTTP {reply.status_code}) to "
                        f"{reply.headers.get('location', '(no location)')}; comlrl never follows redirects, which "
                        "would carry the API key to another address. Set comparator_api_url to the address that "
                        "answers."))
                if reply.status_code >= 400:
                    detail = (await _read(reply, _DETAIL_BYTES, cut=True)).decode("utf-8", "replace")
                    last = self._scrub(f"HTTP {reply.status_code}: {detail}")
                    if reply.status_code in _RETRY_STATUS:
                        raise _Retry(last, _retry_after(reply.headers.get("retry-after")))
                    raise ComparatorError(f"the comparator API at {self.url} refused the request ({last}).")
                declared = reply.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > self.max_bytes:
                    raise self._too_large(int(declared))
                return await _read(reply, self.max_bytes, too_large=self._too_large)

    def _too_large(self, size: int) -> ComparatorError:
        return ComparatorError(f"the comparator API at {self.url} sent a reply of {size} bytes or more, beyond "
                               f"comparator_api_max_response_bytes={self.max_bytes}; raise it if such replies are "
                               "expected.")


async def _read(reply: Any, limit: int, cut: bool = False,
                too_large: Optional[Callable[[int], Exception]] = None) -> bytes:
    """The body of a streamed httpx reply, up to ``limit`` bytes: beyond it, the first ``limit``
    bytes (``cut``) or ``too_large(size)`` is raised."""
    chunks, size = [], 0
    async for chunk in reply.aiter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            if cut:
                break
            raise too_large(size)  # type: ignore[misc]
    return b"".join(chunks)[:limit]


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

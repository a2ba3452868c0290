"""The one rule for secrets in anything comlrl writes or shows: a config's ``to_dict`` and
``repr``, tracker configs (W&B config, MLflow params), checkpoints' ``trainer_state.json``, the
``comlrl train`` record, exception messages.

A value is hidden (shown as ``"<redacted>"``) when it carries a secret

* by name: its key, at any depth, names a credential: a word of it (split at ``_ - . space`` and
  camelCase) is ``key``, ``apikey``, ``token``, ``secret``, ``password``, ``passwd``, ``pwd``,
  ``passphrase``, ``credential(s)``, ``auth``, ``authorization`` or ``cookie`` (so the headers
  ``Authorization``, ``Proxy-Authorization``, ``Cookie``, ``X-Api-Key`` too), or a compound word
  holds one (``accesstoken``, ``authtoken``, ``secretkey``, ``privatekey``, ``sessionid``,
  ``X-Authentication``: see :data:`_SECRET_PARTS`), unless its last word says the value is
  *about* the secret, not the secret (``..._env``, ``..._header``, ``..._prefix``: the name of an
  environment variable or a header, not the key);
* by where it is: every string value of HTTP headers and of an API's extra request body (a field
  whose last word is ``headers``, or ``extra_body``) is hidden whatever its name (numbers and
  booleans stay, so a changed setting there is still seen on resume);
* or by shape: a string that looks like a credential wherever it is (``Bearer ...``, ``Basic
  ...``, ``sk-...`` API keys, GitHub / GitLab / Slack / AWS / Google / Hugging Face / Groq /
  Replicate / Perplexity tokens, JWTs, a URL with a password in it); and in a URL, the value of
  every query parameter (``?key=...``, a signature: nothing tells a key from a setting there).

Nothing here imports the rest of comlrl.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Optional

__all__ = ["REDACTED", "is_secret_name", "is_secret_container", "looks_secret", "redact", "secrets_in", "redact_text"]

REDACTED = "<redacted>"

_SECRET_WORDS = frozenset({"key", "apikey", "token", "secret", "password", "passwd", "pwd", "passphrase", "credential",
                           "credentials", "auth", "authorization", "cookie"})
# Inside one word (compound names written without separators): these spell a credential.
_SECRET_PARTS = ("secret", "passw", "passphrase", "credential", "cookie", "authoriz", "authentic", "sessionid",
                 "sessid", "apikey", "privatekey", "accesskey", "authkey", "signingkey", "clientkey", "masterkey")
_ABOUT_WORDS = frozenset({"env", "header", "prefix"})
_WORD = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")

# Credential shapes, searched anywhere in a string (so error bodies can be scrubbed too).
_SHAPES = re.compile("|".join([
    r"\b(?:bearer|basic|digest|token)\s+[A-Za-z0-9._~+/=\-]{16,}",  # an Authorization header's value
    r"\b(?:sk|pk|rk)-[A-Za-z0-9_\-]{16,}",                           # OpenAI / Anthropic style keys
    r"\b(?:sk|pk|rk)_(?:live|test)_[A-Za-z0-9]{10,}",
    r"\bgh[pousr]_[A-Za-z0-9]{20,}", r"\bgithub_pat_[A-Za-z0-9_]{20,}",
    r"\bxox[abprs]-[A-Za-z0-9\-]{10,}",
    r"\bAKIA[0-9A-Z]{16}\b",
    r"\bAIza[0-9A-Za-z_\-]{30,}",
    r"\bhf_[A-Za-z0-9]{30,}",
    r"\bglpat-[A-Za-z0-9_\-]{16,}",                                  # GitLab
    r"\bya29\.[A-Za-z0-9_\-.]{16,}",                                 # Google OAuth access token
    r"\bgsk_[A-Za-z0-9]{16,}", r"\br8_[A-Za-z0-9]{16,}", r"\bpplx-[A-Za-z0-9]{16,}",  # Groq, Replicate, Perplexity
    r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}",  # a JWT
    r"(?<=://)[^/\s:@]+:[^/\s@]+(?=@)",                                 # user:password@ in a URL
]), re.IGNORECASE)


def _words(name: Any) -> list[str]:
    return [w.lower() for w in _WORD.split(str(name)) if w]


def _secret_word(word: str) -> bool:
    return word in _SECRET_WORDS or word.endswith("token") or any(part in word for part in _SECRET_PARTS)


def is_secret_name(name: Any) -> bool:
    """Whether a field, key or header named ``name`` holds a credential (see the module docstring)."""
    words = _words(name)
    joined = "".join(words)  # Session-Id, api_Key: a compound spelled in parts
    return bool(words) and (any(_secret_word(w) for w in words) or any(part in joined for part in _SECRET_PARTS)) \
        and words[-1] not in _ABOUT_WORDS


def is_secret_container(name: Any) -> bool:
    """Whether every string under ``name`` is secret: HTTP headers, an API's extra request body."""
    words = _words(name)
    return bool(words) and (words[-1] == "headers" or words[-2:] == ["extra", "body"] or words[-1] == "extrabody")


# A URL's query: each parameter's value is hidden (group 1 keeps ``?name=`` / ``&name=``).
_PARAM = re.compile(r"([?&][^\s#=&?]*=)([^\s#&]+)")
_URL_WITH_QUERY = re.compile(r"(?:https?|wss?)://[^\s?#]*\?[^\s#]*", re.IGNORECASE)


def _query_values(text: str) -> list[str]:
    """The values of the query parameters of every URL in ``text``."""
    return [m.group(2) for url in _URL_WITH_QUERY.findall(text) for m in _PARAM.finditer(url)]


def _scrub_queries(text: str) -> str:
    return _URL_WITH_QUERY.sub(lambda url: _PARAM.sub(lambda m: m.group(1) + REDACTED, url.group(0)), text)


def looks_secret(text: str) -> bool:
    """Whether the string ``text`` holds something shaped like a credential."""
    return bool(_SHAPES.search(text))


def _walk(value: Any, name: Optional[Any], hidden: list[str], drop: bool = False, inside: bool = False) -> Any:
    if value is None:
        return None
    if name is not None and is_secret_name(name):
        hidden.extend(_strings(value))
        return REDACTED
    inside = inside or (name is not None and is_secret_container(name))
    if isinstance(value, dict):
        if drop:
            gone = [k for k, v in value.items() if is_secret_name(k) or (inside and _holds_text(v))]
            hidden.extend(s for k in gone for s in _strings(value[k]))
            value = {k: v for k, v in value.items() if k not in gone}
        return {k: _walk(v, k, hidden, drop, inside) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_walk(v, None, hidden, drop, inside) for v in value]
    if isinstance(value, str) and (inside or looks_secret(value)):
        hidden.append(value)
        return REDACTED
    if isinstance(value, str) and _URL_WITH_QUERY.search(value):
        hidden.extend(_query_values(value))
        return _scrub_queries(value)
    return value


def _holds_text(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if isinstance(value, dict):
        return any(_holds_text(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(_holds_text(v) for v in value)


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)
    elif value is not None:
        yield str(value)


def redact(value: Any, name: Optional[Any] = None, drop: bool = False) -> Any:
    """A copy of ``value`` (JSON-like: dicts, lists, tuples as lists, scalars) with every secret
    replaced by ``"<redacted>"``; ``name`` is the field or key ``value`` is stored under. With
    ``drop``, mapping keys that name a secret are left out instead (a record that is read back
    as a config: a placeholder would be taken for a value)."""
    return _walk(value, name, [], drop)


def secrets_in(value: Any, name: Optional[Any] = None) -> list[str]:
    """The strings :func:`redact` would hide in ``value``, to scrub them from a message."""
    hidden: list[str] = []
    _walk(value, name, hidden)
    return hidden


def redact_text(text: str, known: Iterable[Optional[str]] = ()) -> str:
    """``text`` (an error message, a server's reply) with each of the ``known`` secrets and
    anything shaped like a credential replaced by ``"<redacted>"``."""
    for secret in sorted({s for s in known if s and len(s) >= 4}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return _scrub_queries(_SHAPES.sub(REDACTED, text))

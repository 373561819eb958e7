"""A registry login, from where docker keeps it: the docker ``config.json`` files
($DOCKER_CONFIG's, then ~/.docker's) and the credential helpers they name, run here (bounded, a
failure one line: oras logs and goes on anonymously). ``config_hosts`` is the hosts those files
name, the only ones besides the registry's own a token service may be on to get the login."""

from __future__ import annotations

import json
import os
import urllib.parse
from pathlib import Path

from cachectl.bundle.oci_transport import TIMEOUT_ENV
from cachectl.core.errors import BadInput


def docker_configs() -> list[str]:
    """The docker config.json files to read credentials from: $DOCKER_CONFIG's, then ~/.docker's
    (oras adds the latter itself)."""
    configs = []
    if os.environ.get("DOCKER_CONFIG"):
        configs.append(str(Path(os.environ["DOCKER_CONFIG"]) / "config.json"))
    return [c for c in configs if os.path.exists(c)]


_NOT_FOUND = "credentials not found"  # docker-credential-helpers' answer for an unknown server


def helper_for(host: str) -> tuple[str, str] | None:
    """(helper, config file) that holds ``host``'s login: its ``credHelpers`` entry, else the
    ``credsStore``, in $DOCKER_CONFIG's or ~/.docker's config.json; None when a config holds the
    login inline (oras reads those) or names no helper."""
    home = os.path.expanduser("~/.docker/config.json")
    names = [host, *([host.replace("127.0.0.1", "localhost")] if "127.0.0.1" in host else [])]
    store: tuple[str, str] | None = None
    for path in [*docker_configs(), *([home] if os.path.exists(home) else [])]:
        try:
            cfg = json.loads(Path(path).read_bytes())
        except (OSError, ValueError) as exc:
            raise BadInput(f"docker config {path} is not readable JSON ({exc}): fix it") from None
        if not isinstance(cfg, dict):
            raise BadInput(f"docker config {path} is not a JSON object: fix it")
        auths, helpers = cfg.get("auths") or {}, cfg.get("credHelpers") or {}
        for name in names:
            inline = auths.get(name) if isinstance(auths, dict) else None
            if isinstance(inline, dict) and inline.get("auth"):
                return None
            if isinstance(helpers, dict) and (helper := helpers.get(name)):
                return str(helper), path
        if cfg.get("credsStore") and store is None:
            store = str(cfg["credsStore"]), path
    return store


def run_helper(helper: str, config: str, host: str, timeout: float) -> tuple[str, str] | None:
    """``docker-credential-<helper> get`` for ``host`` (docker's credential helper protocol: the
    server on stdin, {"Username", "Secret"} JSON on stdout); None when it holds no login for it.
    Any other failure is one line: a node must not pull anonymously, or hang, because its
    keychain is broken."""
    import subprocess

    binary = f"docker-credential-{helper}"
    fix = f"fix the helper, or its entry in {config}"
    try:
        done = subprocess.run(
            [binary, "get"], input=host.encode(), capture_output=True, timeout=timeout
        )
    except FileNotFoundError:
        raise BadInput(
            f"{config} names the credential helper {binary} for {host}, which is not on PATH: "
            "install it, or remove it from the config"
        ) from None
    except subprocess.TimeoutExpired:
        raise BadInput(
            f"credential helper {binary} did not answer for {host} within {timeout:g} s "
            f"({TIMEOUT_ENV}): {fix}"
        ) from None
    except OSError as exc:
        raise BadInput(f"credential helper {binary} cannot run ({exc.strerror}): {fix}") from None
    said = (done.stdout or done.stderr).decode(errors="replace").strip().splitlines()
    if done.returncode != 0:
        if said and _NOT_FOUND in said[0].lower():
            return None
        why = said[0][:200] if said else f"exit {done.returncode}, no message"
        raise BadInput(f"credential helper {binary} failed for {host} ({why}): {fix}")
    try:
        payload = json.loads(done.stdout)
        user, secret = payload["Username"], payload["Secret"]
        if not isinstance(user, str) or not isinstance(secret, str):
            raise TypeError("Username and Secret are not strings")
    except (ValueError, KeyError, TypeError) as exc:
        raise BadInput(
            f"credential helper {binary} gave no login for {host} (not the protocol's "
            f'{{"Username", "Secret"}} JSON: {exc}): {fix}'
        ) from None
    return user, secret


def _home_config() -> list[str]:
    home = os.path.expanduser("~/.docker/config.json")
    return [home] if os.path.exists(home) else []


def config_hosts() -> set[str]:
    """The hosts (and host:port) the docker config files name in ``auths`` or ``credHelpers``,
    lower case (a key may be a URL, as docker writes Docker Hub's)."""
    named: set[str] = set()
    for path in [*docker_configs(), *_home_config()]:
        try:
            cfg = json.loads(Path(path).read_bytes())
        except (OSError, ValueError, RecursionError):
            continue
        if not isinstance(cfg, dict):
            continue
        for section in (cfg.get("auths"), cfg.get("credHelpers")):
            for key in section if isinstance(section, dict) else ():
                key = str(key)
                parts = urllib.parse.urlsplit(key if "//" in key else f"//{key}")
                if parts.hostname:
                    named.add(parts.hostname.lower())
                    named.add(parts.netloc.rsplit("@", 1)[-1].lower())
    return named

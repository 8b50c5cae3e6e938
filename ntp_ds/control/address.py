"""Store addresses: `HOST:PORT` (a TCPStore) and `etcd://HOST:PORT[,HOST:PORT...][/JOB]` (an etcd cluster), parsed
with errors that name what is wrong."""

from __future__ import annotations

SCHEME = "etcd://"
DEFAULT_JOB = "job"


def parse_address(address: str) -> tuple[str, int]:
    """Split `HOST:PORT` (or `[IPv6]:PORT`) into host and port; raise ValueError naming what is wrong."""
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"store address {address!r} is empty; expected HOST:PORT, e.g. 127.0.0.1:29400")
    text = address.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"store address {address!r}: an IPv6 host must look like [::1]:29400")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"store address {address!r} has no port; expected HOST:PORT, e.g. 127.0.0.1:29400")
        if ":" in host:
            raise ValueError(f"store address {address!r}: write an IPv6 host in brackets, e.g. [::1]:29400")
    if not host:
        raise ValueError(f"store address {address!r} has no host; expected HOST:PORT, e.g. 127.0.0.1:29400")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"store address {address!r}: port {port_text!r} must be an integer in 1..65535")
    return host, int(port_text)


def format_address(host: str, port: int) -> str:
    """Join host and port into the HOST:PORT form that `parse_address` reads."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def validate_address(address: str) -> None:
    """Raise ValueError naming what is wrong with a store address, of either kind."""
    if is_etcd_address(address):
        parse_etcd_address(address)
    else:
        parse_address(address)


def is_etcd_address(address) -> bool:
    return isinstance(address, str) and address.strip().startswith(SCHEME)


def parse_etcd_address(address: str) -> tuple[list[tuple[str, int]], str]:
    """Split `etcd://HOST:PORT[,HOST:PORT...][/JOB]` into its endpoints and job name; raise ValueError naming what is
    wrong."""
    text = address.strip()
    if not text.startswith(SCHEME):
        raise ValueError(f"store address {address!r} must start with {SCHEME}")
    hosts, _, job = text[len(SCHEME):].partition("/")
    job = job.strip("/") or DEFAULT_JOB
    if not all(c.isalnum() or c in "-_." for c in job):
        raise ValueError(f"store address {address!r}: the job name {job!r} may hold letters, digits, '-', '_', '.'")
    if not hosts:
        raise ValueError(f"store address {address!r} names no etcd member; expected {SCHEME}HOST:PORT[,HOST:PORT...]")
    endpoints = []
    for part in hosts.split(","):
        try:
            endpoints.append(parse_address(part))
        except ValueError as e:
            raise ValueError(f"store address {address!r}: member {part!r}: {e}") from None
    return endpoints, job

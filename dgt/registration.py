"""How the sidecars agree, through the rendezvous store (torch.distributed.TCPStore), on
who they are and what they train: each one's endpoints and the session id at start-up,
the model's size and initial parameters when the trainers register, and whether the
pacing rate can move one iteration within --peer-timeout-s.

Every check raises PeerFailure with the line that says what to do and, where one rank
is at fault, that rank. The store calls block: run them off the event loop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
from collections import Counter
from typing import Callable

from .config import PACE_AUTO, NodeConfig, TransmissionConfig, given_flag
from .errors import PeerFailure
from .failure import FailureReason
from .jsonparse import is_port, loads
from .layout import BlockLayout
from .rank_list import rank_list
from .link_rate import auto_pace_mbit, peers_on_loopback
from .rendezvous import Rendezvous
from .scheduler.pacing import flow_share

log = logging.getLogger("dgt.sidecar")



def exchange_endpoints(node: NodeConfig, cfg: TransmissionConfig, me: dict,
                       on_store: Callable[[Rendezvous], None],
                       rejected: Counter | None = None
                       ) -> tuple[Rendezvous, int, dict[int, dict]]:
    """Publish this node's endpoints ``me`` and gather every rank's. Returns (the store,
    the session id: 64 random bits drawn by rank 0, rank -> endpoint). ``on_store`` gets
    the store as soon as it is joined: from then on a failure is published there (the
    others' waits end with it, naming the rank). Values that fail their check are
    counted in ``rejected`` (``store_rejected``) and ignored. Raises PeerFailure."""
    rdv = Rendezvous(node.master_addr, node.master_port, node.world, node.rank,
                     cfg.peer_timeout_s + node.startup_grace_s,
                     listen_fd=node.master_listen_fd,
                     secret=cfg.secret, job=node.job, rejected=rejected,
                     answer_s=cfg.peer_timeout_s)
    on_store(rdv)
    if node.rank == 0:
        rdv.set("dgt/session/0", str(random.SystemRandom().getrandbits(64)))
    rdv.set(f"dgt/ep/{node.rank}", json.dumps({**me, "wire": wire_settings(cfg, node.world)}))
    session = rdv.wait(["dgt/session/0"], check_session)["dgt/session/0"]
    peers = rdv.gather("dgt/ep", check_endpoint)
    agree_wire(peers)
    return rdv, session, peers


#: the flags every rank must give alike: each one shapes what a peer's bytes mean (the
#: block layout and its shards, which UDP port is which band), so a rank apart cannot
#: be understood; a rank started with another --world also waits for ranks that never
#: come, or leaves one out
WIRE_FLAGS = ("block_bytes", "channels", "world")

#: the flags that decide the job's arithmetic, which every rank must also give alike:
#: a rank apart would be understood, but would train another job than the others and
#: than every report says (breaker round 5: hand-started sidecars with --mode tcp and
#: dgt, or int8 and fp32 bands, trained in silence to other bits). Per-node flags stay
#: free: --pace-mbit (a node's port), the waits and timeouts, socket buffers,
#: --drop-udp, --time-budget-ms (a node's own link time), --check-conservation.
JOB_FLAGS = ("mode", "k", "k_min", "adaptive_k", "alpha", "epsilon", "error_feedback",
             "band_codec", "pull_codec", "pull_coded_fraction", "reliable_codec")


def wire_settings(cfg: TransmissionConfig, world: int) -> dict:
    """This rank's values of :data:`WIRE_FLAGS` (``world``: its --world) and of
    :data:`JOB_FLAGS`, as published in its endpoint record."""
    return {"block_bytes": cfg.block_bytes, "channels": cfg.channels, "world": world,
            **{name: getattr(cfg, name) for name in JOB_FLAGS}}


def agree_wire(peers: dict[int, dict]) -> None:
    """Every rank published the same :data:`WIRE_FLAGS` and :data:`JOB_FLAGS` as rank 0
    (``peers``: rank -> endpoint record, :func:`check_endpoint`). Raises PeerFailure
    (MISMATCH) naming the flag, the ranks apart and both values: two sidecars started
    with different --block-bytes or --channels (a hand-started node, a torchrun node
    with its own DGT_* variables) would otherwise fail at their first push, with errors
    that name neither the flag nor the rank; with different --world, the rank that
    counts more ranks would wait out the rendezvous for one that never comes, blaming
    it; with a different --mode, --k or codec the job would train on, another job than
    any rank's report describes. Only the ranks this rank counts are compared: one that
    counts more is refused by a peer that counts fewer, whose failure ends its wait."""
    ref = peers[0]["wire"]
    for name in WIRE_FLAGS + JOB_FLAGS:
        apart = sorted(r for r, ep in peers.items() if ep["wire"][name] != ref[name])
        if not apart:
            continue
        flag = "--" + name.replace("_", "-")
        if name in WIRE_FLAGS:
            got = ", ".join(f"rank {r} has {peers[r]['wire'][name]}" for r in apart)
            text = f"{got}, rank 0 has {flag} {ref[name]}"
        else:
            got = ", ".join(f"rank {r} has {given_flag(name, peers[r]['wire'][name])}"
                            for r in apart)
            text = f"{got}, rank 0 has {given_flag(name, ref[name])}"
        raise PeerFailure(f"{text}; every rank must give the same {flag}", apart[0],
                          FailureReason.MISMATCH, apart)


def check_session(_key: str, text: str) -> int:
    """The session id as stored: a decimal integer in [0, 2^64)."""
    session = int(text)
    if not 0 <= session < 1 << 64:
        raise ValueError("session id out of range")
    return session


def check_endpoint(key: str, text: str) -> dict:
    """A rank's endpoints as stored under ``dgt/ep/<rank>``: a JSON object with that
    ``rank``, ``host`` (str), ``tcp_port`` and ``udp_ports`` (ports 1..65535), ``pid``
    (int) and ``wire`` (:func:`wire_settings`: an int for each of :data:`WIRE_FLAGS`, a
    JSON scalar for each of :data:`JOB_FLAGS`).
    Raises ValueError/TypeError/KeyError otherwise."""
    ep = loads(text)
    if not (type(ep) is dict and ep["rank"] == int(key.rsplit("/", 1)[1])
            and isinstance(ep["host"], str) and ep["host"] and is_port(ep["tcp_port"])
            and type(ep["udp_ports"]) is list and all(map(is_port, ep["udp_ports"]))
            and type(ep["pid"]) is int and type(ep["wire"]) is dict
            and all(type(ep["wire"][f]) is int for f in WIRE_FLAGS)
            and all(type(ep["wire"][f]) in (str, int, float, bool) for f in JOB_FLAGS)):
        raise ValueError("not an endpoint record")
    return ep


def check_model_entry(_key: str, text: str) -> tuple[int, str, int]:
    """``dgt/n_params/<rank>``: "<parameters> <SHA-256 hex or empty> <start iteration>"
    -> (parameters, SHA-256, start)."""
    n, sha, start = text.split(" ")
    if sha and not is_sha256(sha):
        raise ValueError("not a SHA-256")
    n, start = int(n), int(start)
    if not 0 < n < 1 << 31 or start < 0:
        raise ValueError("out of range")
    return n, sha, start


def is_sha256(sha) -> bool:
    """``sha`` is a SHA-256 as ``hexdigest()`` writes it (64 lowercase hex digits)."""
    return isinstance(sha, str) and len(sha) == 64 and all(
        c in "0123456789abcdef" for c in sha)


def check_ready(_key: str, text: str) -> str:
    """``dgt/ready/<rank>``: "1"."""
    if text != "1":
        raise ValueError("not '1'")
    return text


def check_model_size(n_params, rank: int) -> int:
    """``n_params`` of a register message to rank ``rank``'s sidecar, checked: an int
    (not a bool) of 1..2^31-1 parameters. Raises PeerFailure naming the rank."""
    if type(n_params) is not int or not 0 < n_params < 1 << 31:
        raise PeerFailure(f"a register to rank {rank} gives n_params {n_params!r}; "
                          f"need 1..2^31-1 parameters", rank)
    return n_params


def agree_model(rdv: Rendezvous, rank: int, n_params: int, sha: str,
                start: int = 0) -> None:
    """Every rank's trainer registered the same model size, resumes from the same
    iteration ``start`` (dgt.checkpoint; 0: a new run) and, where they sent one, the
    same SHA-256 of the initial parameters ("" : none sent)."""
    rdv.set(f"dgt/n_params/{rank}", f"{n_params} {sha} {start}")
    agreed = rdv.gather("dgt/n_params", check_model_entry,
                        first_cause="its trainer has not registered (dgt.Client.register)")
    sizes = {r: v[0] for r, v in agreed.items()}
    if len(set(sizes.values())) != 1:
        raise PeerFailure(f"trainers registered different model sizes: {sizes}; every "
                          f"rank must train the same model", None,
                          FailureReason.MISMATCH)
    starts = {r: v[2] for r, v in agreed.items()}
    if len(set(starts.values())) != 1:
        raise PeerFailure(f"ranks resume from different iterations: {starts}; give "
                          f"every rank the same checkpoint step", None,
                          FailureReason.MISMATCH)
    shas = {r: v[1] for r, v in agreed.items()}
    apart = [r for r, h in sorted(shas.items()) if h and shas[0] and h != shas[0]]
    if apart:
        raise PeerFailure(f"rank(s) {rank_list(apart)} start from different parameters than rank "
                          f"0 (SHA-256 {shas[apart[0]][:12]}… vs {shas[0][:12]}…); the "
                          f"replicas would never agree: seed the model alike on every "
                          f"rank (torch.manual_seed) or load the same checkpoint before "
                          f"register()", apart[0],
                          FailureReason.MISMATCH, apart)


@dataclasses.dataclass(frozen=True)
class RouteFacts:
    """What the routes to the peers decide for the auto flags: ``pace``, the answer of
    dgt.link_rate.auto_pace_mbit ((Mbit/s, where from)) for --pace-mbit auto, else
    None; ``loopback``, whether the peers are on loopback (peers_on_loopback) when a
    codec is auto, else None."""

    pace: tuple[float, str] | None
    loopback: bool | None


def route_facts(cfg: TransmissionConfig, peers: dict[int, dict], rank: int) -> RouteFacts:
    """Look up :class:`RouteFacts` for this node (blocking: pyroute2's netlink calls).
    The sidecar runs it in a thread as soon as the rendezvous gave the peers, while
    the trainers still start up: pyroute2's import and the route lookups cost about
    0.3 s of CPU per node, which would otherwise lengthen every trainer's register."""
    hosts = [ep["host"] for r, ep in sorted(peers.items()) if r != rank]
    pace = auto_pace_mbit(hosts) if cfg.pace_mbit == PACE_AUTO else None
    loopback = peers_on_loopback(hosts) if cfg.auto_codecs() else None
    return RouteFacts(pace, loopback)


async def agree(rdv: Rendezvous, cfg: TransmissionConfig, peers: dict[int, dict],
                rank: int, world: int, n_params: int, sha, start: int = 0,
                facts: RouteFacts | None = None
                ) -> tuple[TransmissionConfig, BlockLayout, str | None]:
    """At register: :func:`agree_model` (``sha``: the trainer's SHA-256 of its initial
    parameters, anything else: none sent), --pace-mbit auto resolved to this host's
    egress rate towards the ``peers`` (dgt.link_rate), --band-codec, --pull-codec and
    --reliable-codec auto resolved by whether those peers are on loopback, the block layout, and
    :func:`check_pace`. ``facts``: :func:`route_facts` for ``cfg`` and ``peers``,
    looked up earlier (None: looked up here). Returns (the config with the pacing rate,
    the layout, where the rate came from or None when it was given). Raises
    PeerFailure."""
    loop = asyncio.get_running_loop()
    sha = sha if is_sha256(sha) else ""   # "": a client that sends none (or no hex)
    await loop.run_in_executor(None, agree_model, rdv, rank, n_params, sha, start)
    if facts is None:   # pyroute2's sync API cannot run inside a running event loop
        facts = await loop.run_in_executor(None, route_facts, cfg, peers, rank)
    source = None
    if cfg.pace_mbit == PACE_AUTO:
        pace, source = facts.pace
        cfg = dataclasses.replace(cfg, pace_mbit=pace)
        log.info("rank %d: UDP pacing %s (%s)", rank,
                 f"{pace:g} Mbit/s" if pace else "off", source)
    if cfg.auto_codecs():
        loopback = facts.loopback
        cfg = cfg.resolve_codecs(loopback)
        log.info("rank %d: UDP bands %s, PULLs %s, reliable channel %s (auto%s)", rank,
                 cfg.band_codec, cfg.pull_codec, cfg.reliable_codec,
                 ", peers on loopback" if loopback else "")
    lay = BlockLayout.from_bytes(n_params, cfg.block_bytes, world)
    check_pace(cfg, lay, world, rank)
    return cfg, lay, source


def barrier(rdv: Rendezvous, rank: int) -> None:
    """Wait until every rank is ready (its peer connections are up)."""
    rdv.set(f"dgt/ready/{rank}", "1")
    rdv.gather("dgt/ready", check_ready)


def check_pace(cfg: TransmissionConfig, lay: BlockLayout, world: int, rank: int) -> None:
    """Refuse a pacing rate at which one iteration (push, then PULL, of the N-1
    remote shards' bytes) cannot fit in --peer-timeout-s: the job would otherwise
    fail later with a timeout that seems to blame a peer."""
    if cfg.pace_mbit <= 0 or world < 2:
        return
    share = flow_share(cfg.pace_mbit, world - 1) * (world - 1)
    need_s = 2 * 4 * lay.padded * (world - 1) / world / share
    if need_s > cfg.peer_timeout_s:
        raise PeerFailure(
            f"--pace-mbit {cfg.pace_mbit:g} moves one iteration of this model "
            f"({4 * lay.padded / 1e6:.3g} MB of gradient, {world} nodes) in about "
            f"{need_s:.0f} s, more than --peer-timeout-s {cfg.peer_timeout_s:g}; "
            f"raise --pace-mbit (or auto) or --peer-timeout-s", rank)

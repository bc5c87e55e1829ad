"""The online adapter: the decode loop's handle on draft adaptation, and its worker.

Owns: per-key adapter states (trainer, replay buffer, published weights, version; at most
``max_keys``, least recently used evicted), the worker that gates trajectories and runs
updates, the double-buffered publication into the serving head, and save / load / reset.
The adapter file's format and its checks live in :mod:`evospec.adapt.adapter_file`.

Decode-thread contract (called by ``decoding/speculative.py``; all cheap, never blocking):
``select(key)`` before a request, ``start()`` after its prefill, ``begin_round(features,
tokens)`` with the pairs the drafter commits (this is where a newer published version is
copied into the serving head: between rounds, never inside one), and ``end_round(...)``
after verification, which records a :class:`~evospec.adapt.trajectory.Trajectory` and
hands it to the worker (a full queue drops it and counts the drop).

Worker contract: trajectories are gated in batches under the current shadow weights
(``loss.admit``); admitted steps fill the key's replay buffer; at ``buffer_size`` admitted
steps one update runs and the buffer is cleared. A successful update publishes new
serving weights (a fresh dict: the back buffer) and bumps the version; a discarded one
publishes nothing. On CPU the worker is a niced background thread; on CUDA it runs on a
low-priority side stream and the decode thread waits on the update's event only when it
copies the published weights. With ``asynchronous=False`` everything runs inline at the
round end (deterministic; tests).

Output never changes: only the draft's weights move, and the target verifies every token.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from evospec.adapt.adapter_file import adapter_bytes, parse_adapter, read_adapter, write_adapter
from evospec.adapt.config import AdaptConfig
from evospec.adapt.trainers import OnlineTrainer, make_trainer, qv_names, tensor_bytes
from evospec.adapt.trajectory import Recorder, Trajectory, stores_nbytes
from evospec.adapt.unroll import collate
from evospec.kernels.streams import on_stream, record_event, side_stream, wait_event
from evospec.models.eagle import EagleHead

log = logging.getLogger(__name__)

DEFAULT_KEY = ""  # the state of requests without a key
_GATE_BATCH = 32  # trajectories gated per worker pass at most
_HISTORY = 1024  # update times and losses kept for the stats


@dataclass
class AdaptStats:
    trajectories: int = 0  # recorded rounds handed to the worker
    dropped: int = 0  # recorded rounds dropped because the worker was behind
    steps_seen: int = 0  # verified positions the gate looked at
    routed_oov: int = 0  # ... left to the vocabulary path (verified token not active)
    admitted: int = 0  # ... admitted to a replay buffer
    by_kl: int = 0
    by_reject: int = 0
    updates: int = 0  # successful updates (each published a version)
    discarded: int = 0  # updates thrown away (the previous adapter stayed)
    discard_reasons: Counter = field(default_factory=Counter)
    errors: int = 0  # worker exceptions (the batch was skipped)
    update_s: deque[float] = field(default_factory=lambda: deque(maxlen=_HISTORY))  # the latest ones
    losses: deque[float] = field(default_factory=lambda: deque(maxlen=_HISTORY))
    publishes: int = 0  # weight copies into the serving head (decode thread)
    publish_s: float = 0.0
    # per new version of the key being served: rounds that still ran on older weights after
    # the newest round the update learned from (0: served from the very next round)
    publish_lag: deque[int] = field(default_factory=lambda: deque(maxlen=_HISTORY))

    def as_dict(self) -> dict:
        upd = sorted(self.update_s)
        return {
            "trajectories": self.trajectories,
            "dropped": self.dropped,
            "steps_seen": self.steps_seen,
            "routed_oov": self.routed_oov,
            "admitted": self.admitted,
            "admitted_by_kl": self.by_kl,
            "admitted_by_reject": self.by_reject,
            "updates": self.updates,
            "discarded": self.discarded,
            "discard_reasons": dict(self.discard_reasons),
            "errors": self.errors,
            "update_ms_median": round(1e3 * upd[len(upd) // 2], 2) if upd else None,
            "last_loss": self.losses[-1] if self.losses else None,
            "publishes": self.publishes,
            "publish_ms_total": round(1e3 * self.publish_s, 3),
            "publish_lag_rounds": _quantiles(self.publish_lag),
        }


def _quantiles(xs) -> dict | None:
    s = sorted(xs)
    if not s:
        return None
    return {"median": s[len(s) // 2], "p90": s[min(len(s) - 1, (9 * len(s)) // 10)], "max": s[-1]}


@dataclass
class KeyState:
    trainer: OnlineTrainer
    buffer: list[tuple[Trajectory, torch.Tensor]] = field(default_factory=list)  # (traj, admitted [s])
    buffered: int = 0  # admitted steps in the buffer
    version: int = 0  # published versions so far (0: the base head)
    front_round: int = -1  # newest recorded round the published version learned from
    front: dict[str, torch.Tensor] | None = None  # the latest published serving weights
    event: object | None = None  # CUDA: marks when ``front`` is ready


class OnlineAdapter:
    def __init__(self, head: EagleHead, lm_head: torch.Tensor, cfg: AdaptConfig | None = None) -> None:
        self.cfg = cfg or AdaptConfig()
        self.head = head  # the serving head (the drafter's); its weights change between rounds
        self.lm_head = lm_head
        # the base weights of what this mode overwrites in the serving head (clora: q/v; osd:
        # every head parameter but the embedding), for new keys and resets
        moved = qv_names(head) if self.cfg.mode == "clora" else None
        self.pristine = {
            n: p.detach().clone()
            for n, p in head.named_parameters()
            if (n in moved if moved is not None else not n.startswith("embed_tokens"))
        }
        self.stats = AdaptStats()
        self.enabled = True  # False: rounds are not recorded, so no update runs (weights stay)
        self._states: OrderedDict[str, KeyState] = OrderedDict()
        self._lock = threading.Lock()
        self._key = DEFAULT_KEY  # key of the request being decoded
        self._serving: tuple[str, int] = (DEFAULT_KEY, 0)  # (key, version) loaded in the serving head
        self._round = 0  # rounds recorded so far (decode thread)
        self.recorder = Recorder(self.cfg.context, self.cfg.k_logit)
        self._device = head.fc.weight.device  # fp32 heads only: the adapting copy is never quantised
        self._queue: queue.Queue[Trajectory | None] = queue.Queue(maxsize=self.cfg.max_pending)
        self._busy = threading.Event()  # the worker holds work taken from the queue
        self._thread: threading.Thread | None = None
        self._stream = None
        if self.cfg.asynchronous:
            self._stream = side_stream(self._device, "low")  # None off CUDA
            self._thread = threading.Thread(target=self._worker, name="evospec-adapt", daemon=True)
            self._thread.start()

    @property
    def mode(self) -> str:
        return self.cfg.mode

    # -- decode thread -----------------------------------------------------------------------
    def select(self, key: str | None) -> None:
        """The next request belongs to ``key`` (None: the default state)."""
        self._key = key or DEFAULT_KEY
        self._publish()

    def start(self) -> None:
        self.recorder.start()

    def begin_round(self, features: torch.Tensor, tokens: torch.Tensor) -> None:
        """features [m, D], tokens [m]: the pairs the drafter commits this round."""
        self._publish()
        self.recorder.commit(features, tokens)

    def end_round(
        self,
        tree_parents: torch.Tensor,  # [N]
        path: torch.Tensor,  # [a + 1]
        verified: torch.Tensor,  # [a + 1]
        path_logits: torch.Tensor,  # [a + 1, V]
        active: torch.Tensor | None,  # [V] bool, None: the full vocabulary
    ) -> None:
        if not self.enabled:
            return
        traj = self.recorder.trajectory(tree_parents, path, verified, path_logits, active, self._key)
        traj.round = self._round
        self._round += 1
        if self._stream is not None:  # the worker's stream must wait for these tensors
            traj.ready = record_event(torch.cuda.current_stream(self._device))
        self.stats.trajectories += 1
        if self._thread is None:
            self._process([traj])
            return
        try:
            self._queue.put_nowait(traj)
        except queue.Full:
            self.stats.dropped += 1

    def _publish(self) -> None:
        """Load the current key's newest published weights into the serving head, if newer."""
        with self._lock:
            st = self._states.get(self._key)
            version = st.version if st is not None else 0
            if (self._key, version) == self._serving:
                return
            weights = st.front if st is not None and st.front is not None else None
            event = st.event if st is not None else None
            learned_to = st.front_round if st is not None else -1
            same_key = self._serving[0] == self._key
        t0 = time.perf_counter()
        wait_event(event)  # CUDA: the copy below runs after the update's kernels
        if weights is None:  # a key without updates serves the base head
            weights = self.pristine
        named = dict(self.head.named_parameters())
        with torch.no_grad():
            for name, w in weights.items():
                named[name].copy_(w)
        self._serving = (self._key, version)
        if same_key and learned_to >= 0:
            self.stats.publish_lag.append(max(0, self._round - learned_to - 1))
        self.stats.publishes += 1
        self.stats.publish_s += time.perf_counter() - t0

    # -- worker ------------------------------------------------------------------------------
    def _worker(self) -> None:
        if self._device.type == "cpu":
            # One intra-op thread for the updates (per-thread in OpenMP: the decode thread keeps
            # its own). Otherwise this thread gets its own OpenMP team on every core, which keeps
            # competing with the decode thread's after the updates are done: three idle adaptive
            # decoders in one process took AR from 162 to 85 tok/s on 2 cores; 181 with this.
            torch.set_num_threads(1)
        if self._device.type == "cpu" and self.cfg.nice:
            # Linux: niceness is per thread; torch's threads spawned from here inherit it
            with contextlib.suppress(AttributeError, OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.cfg.nice)
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._busy.set()
            batch = [item]
            while len(batch) < _GATE_BATCH:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(nxt)
            try:
                with on_stream(self._stream):
                    for t in batch:
                        wait_event(t.ready)  # device-side: the side stream follows the decode stream
                        for x in t.tensors():
                            if x.is_cuda:
                                x.record_stream(self._stream)  # not reused while the side stream reads it
                    self._process(batch)
            except Exception:
                self.stats.errors += 1
                log.exception("adapt: worker batch failed; skipped")
            finally:
                self._busy.clear()

    def _state(self, key: str) -> KeyState:
        with self._lock:
            st = self._states.get(key)
            if st is not None:
                self._states.move_to_end(key)
                return st
        trainer = make_trainer(self.head, self.pristine, self.lm_head, self.cfg)  # outside the lock
        with self._lock:
            st = self._states.setdefault(key, KeyState(trainer))
            self._states.move_to_end(key)
            while len(self._states) > self.cfg.max_keys:
                self._states.popitem(last=False)
            return st

    def _process(self, trajs: list[Trajectory]) -> None:
        with torch.inference_mode(False), torch.enable_grad():  # inline mode runs inside the decode loop
            self._process_batch(trajs)

    def _process_batch(self, trajs: list[Trajectory]) -> None:
        by_key: dict[str, list[Trajectory]] = {}
        for t in trajs:
            by_key.setdefault(t.key or DEFAULT_KEY, []).append(t)
        for key, group in by_key.items():
            st = self._state(key)
            batch = collate(group, self._device)
            adm, _ = st.trainer.gate(batch)
            s = self.stats
            s.steps_seen += int(batch.step_valid.sum())
            s.routed_oov += adm.routed_oov
            s.admitted += int(adm.mask.sum())
            s.by_kl += adm.by_kl
            s.by_reject += adm.by_reject
            for i, t in enumerate(group):
                m = adm.mask[i, : t.steps]
                if bool(m.any()):
                    st.buffer.append((t, m.clone()))
                    st.buffered += int(m.sum())
                if st.buffered >= self.cfg.buffer_size:  # a worker that fell behind still updates every B
                    self._update(key, st)

    def _update(self, key: str, st: KeyState) -> None:
        items, st.buffer, st.buffered = st.buffer, [], 0
        batch = collate([t for t, _ in items], self._device)
        admitted = torch.zeros_like(batch.step_valid)
        for i, (_, m) in enumerate(items):
            admitted[i, : m.shape[0]] = m
        res = st.trainer.step(batch, admitted)
        self.stats.update_s.append(res.seconds)
        self.stats.losses.append(res.loss)
        if not res.ok:
            self.stats.discarded += 1
            self.stats.discard_reasons[res.reason] += 1
            log.warning(
                "adapt: update discarded (%s, loss %.4g); previous adapter kept", res.reason, res.loss
            )
            return
        weights = st.trainer.serving_weights()
        event = record_event(self._stream)
        with self._lock:
            if self._states.get(key) is st:  # not evicted or reset meanwhile
                st.front, st.event = weights, event
                st.front_round = max(t.round for t, _ in items)
                st.version += 1
        self.stats.updates += 1

    # -- control (engine thread, between requests or rounds) --------------------------------
    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until the worker has processed everything queued (bench and tests)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.empty() and not self._busy.is_set():
                return True
            time.sleep(0.005)
        return False

    def buffered(self, key: str | None = None) -> int:
        """Admitted positions waiting in ``key``'s replay buffer."""
        with self._lock:
            st = self._states.get(key or DEFAULT_KEY)
            return st.buffered if st is not None else 0

    def versions(self) -> dict[str, int]:
        with self._lock:
            return {k: st.version for k, st in self._states.items()}

    def aux_bytes(self) -> dict[str, int]:
        """Memory held for adaptation (all keys): trainer state + replay buffers + base copy."""
        with self._lock:
            states = list(self._states.values())
        out = Counter()
        for st in states:
            out.update(st.trainer.aux_bytes())
            out["buffer"] += sum(t.nbytes() for t, _ in st.buffer) + stores_nbytes(t for t, _ in st.buffer)
            out["published"] += tensor_bytes((st.front or {}).values())
        out["base_copy"] = tensor_bytes(self.pristine.values())
        out["total"] = sum(v for k, v in out.items() if k != "total")
        return dict(out)

    def state(self) -> dict:
        with self._lock:
            keys = {
                (k or "default"): {"version": st.version, "buffered": st.buffered}
                for k, st in self._states.items()
            }
        return {
            "mode": self.cfg.mode,
            "enabled": self.enabled,
            "asynchronous": self.cfg.asynchronous,
            "buffer_size": self.cfg.buffer_size,
            "lr": self.cfg.lr,
            "rank": self.cfg.rank if self.cfg.mode == "clora" else None,
            "serving": {"key": self._serving[0] or "default", "version": self._serving[1]},
            "keys": keys,
            "max_keys": self.cfg.max_keys,
            "queue": self._queue.qsize(),
            "aux_bytes": self.aux_bytes(),
            **self.stats.as_dict(),
        }

    def reset(self, key: str | None = None, *, all_keys: bool = False) -> dict:
        """Forget one key's adapter (default key when None) or all; the serving head goes back
        to the base weights at the next round boundary."""
        self.wait_idle()
        with self._lock:
            if all_keys:
                dropped = len(self._states)
                self._states.clear()
            else:
                dropped = int(self._states.pop(key or DEFAULT_KEY, None) is not None)
            self._serving = ("\0stale", -1)  # force a reload at the next boundary
        self._publish()
        return {"reset_keys": dropped}

    def export(self, key: str | None = None) -> bytes:
        """One key's adapter as the bytes of an adapter file (:mod:`~evospec.adapt.adapter_file`),
        once the worker has finished what it holds (a consistent copy: write it anywhere later)."""
        self.wait_idle()
        st = self._state(key or DEFAULT_KEY)
        return adapter_bytes(st.trainer.adapter_tensors(), self.cfg, self.head, st.version)

    def save(self, path: str | Path, key: str | None = None) -> Path:
        """Write one key's adapter to ``path`` (a trusted path; the admin API writes :meth:`export`
        into its own folder)."""
        self.wait_idle()
        st = self._state(key or DEFAULT_KEY)
        return write_adapter(path, st.trainer.adapter_tensors(), self.cfg, self.head, st.version)

    def parse(self, data: bytes, source: str) -> dict[str, torch.Tensor]:
        """The tensors of adapter-file bytes, validated for this adapter's mode, LoRA settings and
        head (ValueError naming ``source``); touches no state, so any thread may call it."""
        return parse_adapter(data, self.cfg, self.head, source)

    def load(self, path: str | Path, key: str | None = None) -> dict:
        """Install the adapter file at ``path`` for ``key`` and publish it (next round boundary);
        the file is validated (:func:`~evospec.adapt.adapter_file.read_adapter`) before the worker
        is waited on."""
        return self.install(read_adapter(path, self.cfg, self.head), key)

    def install(
        self, tensors: dict[str, torch.Tensor], key: str | None = None, version: int | None = None
    ) -> dict:
        """Install validated adapter tensors for ``key`` as its next version (``version``: as that
        version, for a restart's snapshot) and publish them at the next round boundary; the key's
        replay buffer is emptied."""
        self.wait_idle()
        k = key or DEFAULT_KEY
        st = self._state(k)
        dev = self._device
        st.trainer.load_adapter_tensors({n: t.to(dev) for n, t in tensors.items()})
        weights = st.trainer.serving_weights()
        with self._lock:
            st.buffer, st.buffered = [], 0
            st.front, st.event, st.front_round = weights, None, -1
            st.version = st.version + 1 if version is None else version
            if k == self._key:
                self._serving = ("\0stale", -1)  # reload even if the version number repeats
        if k == self._key:
            self._publish()
        return {"key": k or "default", "version": st.version, "tensors": len(tensors)}

    def learnt(self) -> list[tuple[str, int, dict[str, torch.Tensor]]]:
        """``(key, version, adapter tensors on the CPU)`` of every key that published at least one
        version, least recently used first, once the worker has finished what it holds (what a
        restart snapshot keeps; replay buffers and optimizer state are not kept)."""
        self.wait_idle()
        with self._lock:
            states = [(k, st) for k, st in self._states.items() if st.version > 0]
        return [
            (k, st.version, {n: t.detach().cpu() for n, t in st.trainer.adapter_tensors().items()})
            for k, st in states
        ]

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            while True:  # make room for the stop marker; queued rounds are dropped
                try:
                    self._queue.put_nowait(None)
                    break
                except queue.Full:
                    with contextlib.suppress(queue.Empty):
                        self._queue.get_nowait()
            self._thread.join(timeout=30)

"""Persistent, bounded, per-tenant store of finished requests' tokens for the suffix drafter.

On disk (a directory):
  log.bin        append-only; one framed record per finished request, fsynced before ``add`` returns
  snapshot.bin   every live record at some point, written to snapshot.tmp, fsynced, then renamed over; then the
                 log is emptied in place (truncated and fsynced: a crash in between leaves records the snapshot
                 holds, which the load skips)
  store.json     the tokenizer whose token ids the records are (:meth:`SuffixStore.bind_tokenizer`): a store
                 written under another tokenizer is refused, since its ids would draft other tokens

Record frame: ``<4s magic "SXR1"><u32 payload length><u32 crc32(seq, payload)><u64 seq>`` then the payload
``<u16 tenant length><tenant utf-8><int32 tokens...>``. Sequence numbers grow by one per record; a
snapshot's header (``<8s "SXSNAP02"><u64 last seq><u32 crc32 of the 16 bytes before>``; "SXSNAP01" files, without
the checksum, are still read) names the last sequence number it holds, so log records at or below it (left by a
crash between writing a snapshot and emptying the log) are skipped. A header that fails its checksum, or names a
number below its own records' or past 2^63, is reported and replaced by its records' largest number (the newest
record of a snapshot always stays in it), so one flipped bit cannot hide acknowledged log records. A torn or corrupt record is
reported with ``warnings.warn`` (file and byte offset) and skipped; reading resumes at the next valid
frame, so records fsynced after a damaged one are kept. A load that found damage writes a fresh
snapshot at once, so the damage is reported once; the damaged file is first copied to ``<name>.damaged`` beside it
(the last damage's), so what could not be read is not destroyed by that rewrite.

Tenancy: every record carries a tenant id, and :meth:`SuffixStore.index_for` gives each tenant an index
of its own records only, unless the store was opened with ``share=True``. Drafting never changes what
is generated (verification is exact), but it changes how fast: a tenant who sees a continuation come
out unusually fast learns that someone else generated it before, a timing side channel. So sharing
across tenants is an operator's explicit choice.

Bound, per tenant: each tenant keeps at most ``max_tokens`` tokens; beyond that *its own* oldest requests
are evicted (down to 90% of the bound, so eviction and the index rebuild it needs are amortised). One
tenant's traffic never evicts another's records through this bound (with ``share=True`` too: the bound is still
counted per tenant, the shared index is rebuilt from what every tenant kept). Bound, in all: the store keeps at most
``max_total_tokens`` tokens (default :data:`TOTAL_PER_TENANT` x ``max_tokens``); beyond that the oldest requests of
any tenant are evicted, down to 90% (session 44: without it a server without API keys, where every distinct
``user`` field is a tenant, grew without end). The records cost 4 bytes per token and ~0.5 KB per request; the
indices of the :attr:`SuffixStore.MAX_INDICES` tenants that drafted last stay in memory (~12 bytes per token of a
long history, ~11 KB for one 45-token request), any other is rebuilt from its records when its tenant drafts again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
import threading
import warnings
import weakref
import zlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .suffix_index import SuffixIndex

try:  # POSIX: the directory's lock (elsewhere one store per directory is the user's to keep)
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

_OPEN_STORES: weakref.WeakSet = weakref.WeakSet()  # stores holding their directory (a forked child lets go)


def _after_fork_in_child() -> None:
    """A forked child shares its parent's lock files: it closes its copies (the parent keeps the directory), so the
    parent's close() lets other processes in; the child's stores open the directory anew if they add."""
    for st in list(_OPEN_STORES):
        st._lock = threading.Lock()  # another thread of the parent may have held it at the fork: it never lets go here
        for f in (st._log, st._dir_lock):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        st._log = st._dir_lock = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

MAGIC = b"SXR1"
_HEAD = struct.Struct("<4sIIQ")  # magic, payload length, crc32, seq
_SNAP_HEAD_V1 = struct.Struct("<8sQ")  # b"SXSNAP01", last seq included (read only)
_SNAP_MAGIC_V1 = b"SXSNAP01"
_SNAP_HEAD = struct.Struct("<8sQI")  # b"SXSNAP02", last seq included, crc32 of the 16 bytes before
_SNAP_MAGIC = b"SXSNAP02"
_MAX_SEQ = 1 << 63
_MAX_PAYLOAD = 1 << 30
SHARED = "\x00shared"  # the index key used when share=True


@dataclass(frozen=True, eq=False)
class Record:
    """One finished request: tenant id and the token ids that were indexed."""

    seq: int
    tenant: str
    tokens: np.ndarray  # (n,) int32, read-only


def encode_record(seq: int, tenant: str, tokens: Sequence[int]) -> bytes:
    """Frame one record (header + payload)."""
    t = tenant.encode("utf-8")
    if len(t) > 0xFFFF:
        raise ValueError(f"tenant id is {len(t)} bytes; at most 65535")
    payload = struct.pack("<H", len(t)) + t + np.asarray(tokens, dtype="<i4").tobytes()
    crc = zlib.crc32(payload, zlib.crc32(struct.pack("<Q", seq)))
    return _HEAD.pack(MAGIC, len(payload), crc, seq) + payload


def decode_records(data: bytes, name: str, start: int = 0) -> tuple[list[Record], bool]:
    """Parse framed records from ``data[start:]``; warn (naming ``name`` and the offset) on damage.

    Returns (records, damaged). A bad frame is skipped up to the next frame that parses and checks out.
    """
    out: list[Record] = []
    off, damaged, n = start, False, len(data)
    while off < n:
        rec, end = _parse_at(data, off)
        if rec is not None:
            out.append(rec)
            off = end
            continue
        damaged = True
        nxt = data.find(MAGIC, off + 1)
        while nxt >= 0 and _parse_at(data, nxt)[0] is None:
            nxt = data.find(MAGIC, nxt + 1)
        if nxt < 0:
            warnings.warn(
                f"suffix store {name}: torn or corrupt tail at byte offset {off} ({n - off} bytes) dropped",
                stacklevel=3,
            )
            break
        warnings.warn(
            f"suffix store {name}: corrupt record at byte offset {off} skipped "
            f"({nxt - off} bytes); reading resumes at offset {nxt}",
            stacklevel=3,
        )
        off = nxt
    return out, damaged


def _parse_at(data: bytes, off: int) -> tuple[Record | None, int]:
    if off + _HEAD.size > len(data):
        return None, off
    magic, ln, crc, seq = _HEAD.unpack_from(data, off)
    body = off + _HEAD.size
    if magic != MAGIC or ln < 2 or ln > _MAX_PAYLOAD or body + ln > len(data):
        return None, off
    payload = data[body : body + ln]
    if zlib.crc32(payload, zlib.crc32(struct.pack("<Q", seq))) != crc:
        return None, off
    (tl,) = struct.unpack_from("<H", payload, 0)
    if 2 + tl > ln or (ln - 2 - tl) % 4:
        return None, off
    try:
        tenant = payload[2 : 2 + tl].decode("utf-8")
    except UnicodeDecodeError:
        return None, off
    toks = np.frombuffer(payload, dtype="<i4", offset=2 + tl).astype(np.int32)
    toks.flags.writeable = False
    return Record(seq, tenant, toks), body + ln


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


DEFAULT_MAX_TOKENS = 1_000_000  # tokens a tenant keeps at most (--suffix-max-tokens, suffix_max_tokens=)
TOTAL_PER_TENANT = 16  # the store's default bound in all: this many tenants' worth (--suffix-max-total-tokens)


class SuffixStore:
    """Finished requests of every tenant, on disk (optional) and as one suffix index per tenant."""

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        share: bool = False,
        snapshot_every: int = 256,
        fsync: bool = True,
        max_total_tokens: int | None = None,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"suffix_max_tokens (--suffix-max-tokens) must be >= 1, got {max_tokens}")
        if max_total_tokens is not None and max_total_tokens < 1:
            raise ValueError(
                f"suffix_max_total_tokens (--suffix-max-total-tokens) must be >= 1, got {max_total_tokens}"
            )
        self.path = Path(path) if path is not None else None
        self.max_tokens, self.share, self.fsync = max_tokens, share, fsync
        self.max_total_tokens = TOTAL_PER_TENANT * max_tokens if max_total_tokens is None else max_total_tokens
        self.snapshot_every = snapshot_every
        self._records: deque[Record] = deque()  # every tenant's, oldest first
        self._tokens = 0
        self._tenant_tokens: dict[str, int] = {}
        self._seq = 0
        self._since_snapshot = 0
        # the tenants' indices, most recently drafted from last: at most MAX_INDICES are kept; another is rebuilt from
        # its records when its tenant drafts again (an index costs ~250 bytes per token of short requests, and without
        # API keys every distinct `user` field is a tenant: ~11 KB each for ever, where records alone cost ~0.5 KB)
        self._indices: OrderedDict[str, SuffixIndex] = OrderedDict()
        self._lock = threading.Lock()
        # the largest token id loaded or added (bind_tokenizer checks it: records a smaller bound drops at load stay on
        # disk until the next write)
        self._max_id = -1
        self._log = None
        self._dir_lock = None  # the directory's lock file, held while this store has it open
        if self.path is not None:
            self._open()

    # ---- public ------------------------------------------------------------
    @property
    def lock(self) -> threading.Lock:
        """Held by every change; hold it while reading an index another thread may add to."""
        return self._lock

    @property
    def num_tokens(self) -> int:
        """Tokens held (all tenants)."""
        return self._tokens

    def tenant_tokens(self, tenant: str = "") -> int:
        """Tokens held for one tenant (each is bounded by ``max_tokens``)."""
        return self._tenant_tokens.get(tenant, 0)

    def records(self, tenant: str | None = None) -> list[Record]:
        """Live records, oldest first (of one tenant, or all)."""
        with self._lock:  # another thread's add() may be changing the deque
            return [r for r in self._records if tenant is None or r.tenant == tenant]

    MAX_INDICES = 256  # tenants' indices kept in memory at once (least recently drafted from dropped first)

    def index_for(self, tenant: str = "") -> SuffixIndex:
        """The index a request of ``tenant`` drafts from: its own records, or everyone's when shared."""
        key = SHARED if self.share else tenant
        with self._lock:
            idx = self._indices.get(key)
            if idx is None:
                idx = SuffixIndex.from_sequences(r.tokens for r in self._records if self.share or r.tenant == key)
                self._indices[key] = idx
                while len(self._indices) > self.MAX_INDICES:
                    self._indices.popitem(last=False)
            else:
                self._indices.move_to_end(key)
            return idx

    for_tenant = index_for

    def bind_tokenizer(self, fingerprint: str, vocab_size: int) -> None:
        """Tie an on-disk store to the tokenizer whose token ids it holds (``fingerprint``: :func:`tokenizer_fingerprint`).

        A store whose ``store.json`` names another tokenizer is refused with a ValueError: its token ids mean other
        tokens here, and ids past this vocabulary would fail every request they were drafted for. A store without
        one (new, or written before session 39) takes this tokenizer, once its ids are checked to fit the vocabulary.
        """
        if self.path is None:
            return
        fingerprint = fingerprint or f"vocab-{int(vocab_size)}"  # no tokenizer to read: the vocabulary's size
        meta = self.path / "store.json"
        want = {"tokenizer_sha256": fingerprint, "vocab_size": int(vocab_size)}
        with self._lock:
            self._reopen()  # closed: take the directory again (another store may hold it now)
            if meta.exists():
                try:
                    have = json.loads(meta.read_text())
                except (OSError, ValueError) as e:
                    raise ValueError(
                        f"suffix store {self.path}: cannot read {meta.name} ({e}); move the directory aside or give "
                        "another --suffix-store"
                    ) from None
                if have.get("tokenizer_sha256") != fingerprint:
                    raise ValueError(
                        f"suffix store {self.path} holds the token ids of another tokenizer (a vocabulary of "
                        f"{have.get('vocab_size')} tokens, this model's has {vocab_size}, or the same size with other "
                        "tokens): its records would draft other tokens; give this model its own --suffix-store "
                        "directory"
                    )
                return
            top = self._max_id
            if top >= vocab_size:
                raise ValueError(
                    f"suffix store {self.path} holds token id {top}, past this model's vocabulary of {vocab_size} "
                    "tokens: it was written for another model; give this model its own --suffix-store directory"
                )
            tmp = self.path / "store.json.tmp"
            with open(tmp, "w") as f:
                json.dump(want, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, meta)
            _fsync_dir(self.path)

    def add(self, tokens: Sequence[int], tenant: str = "") -> int:
        """Record a finished request; durable (fsynced) when this returns with a store dir. Returns its seq.

        A request longer than the bound keeps its last ``max_tokens`` tokens (what its tenant may hold at most)."""
        toks = np.array(tokens, dtype=np.int64)
        if toks.size == 0:
            return -1
        toks = toks[-self.max_tokens :]
        if toks.min() < 0 or toks.max() > np.iinfo(np.int32).max:
            raise ValueError(f"token ids must be in [0, 2^31), got {int(toks.min())}..{int(toks.max())}")
        toks = toks.astype(np.int32)
        toks.flags.writeable = False
        with self._lock:
            self._reopen()
            self._seq += 1
            rec = Record(self._seq, tenant, toks)
            if self.path is not None:
                self._log.write(encode_record(rec.seq, tenant, toks))
                self._log.flush()
                if self.fsync:
                    os.fsync(self._log.fileno())
            self._append(rec)
            idx = self._indices.get(SHARED if self.share else tenant)
            if idx is not None:
                idx.add_sequence(toks)
            evicted = self._evict(tenant) != (0, 0)
            evicted |= self._evict_total(rec) != (0, 0)
            self._since_snapshot += 1
            if self.path is not None and (evicted or self._since_snapshot >= self.snapshot_every):
                try:
                    self._snapshot()
                except OSError as e:  # the record is durable in the log already: the next add tries again
                    warnings.warn(
                        f"suffix store {self.path}: could not write a snapshot ({e}); the records are safe in "
                        f"log.bin, the next request's add tries again (free space in {self.path.parent}?)",
                        stacklevel=2,
                    )
                    self._since_snapshot = self.snapshot_every
            return rec.seq

    def snapshot(self) -> None:
        """Write every live record to snapshot.bin (atomically) and empty the log."""
        if self.path is None:
            return
        with self._lock:
            self._reopen()  # closed: another store may hold the directory now; write what is there
            self._snapshot()

    def close(self) -> None:
        """Close the log file (records are already durable) and let go of the directory; a later :meth:`add` opens
        it again (reading what other stores wrote there meanwhile)."""
        with self._lock:
            if self._log is not None:
                self._log.close()
                self._log = None
            if self._dir_lock is not None:
                self._dir_lock.close()  # (closing the file releases its lock)
                self._dir_lock = None

    # ---- the directory ----------------------------------------------------
    def _reopen(self) -> None:
        """With a store directory that this store let go of (:meth:`close`, or a fork's child): take it again and load
        what is there now, before any write (writing without the lock would replace another store's files)."""
        if self.path is not None and self._dir_lock is None:
            self._open()

    def _open(self) -> None:
        """Take the directory (one store at a time: two writers handed out the same sequence numbers and one's
        records were lost) and load it."""
        assert self.path is not None
        if not self.path.is_dir():
            if not self.path.parent.is_dir():  # a mistyped path would quietly start a new, empty store
                raise ValueError(
                    f"suffix store {self.path}: its parent directory {self.path.parent} does not exist; create it "
                    "first, or check the path"
                )
            self.path.mkdir(exist_ok=True)
            print(f"treedraft: starting a new suffix store in {self.path}", file=sys.stderr, flush=True)
        f = open(self.path / "lock", "a+")  # held open while the store is: its lock
        if fcntl is not None:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                raise ValueError(
                    f"suffix store {self.path} is open in another store (a server, an earlier treedraft.load in this "
                    "process or another one); close that one first (llm.close()), or give another directory"
                ) from None
        self._dir_lock = f
        _OPEN_STORES.add(self)
        self._records.clear()
        self._tokens, self._tenant_tokens, self._seq, self._since_snapshot, self._max_id = 0, {}, 0, 0, -1
        self._indices.clear()
        try:
            self._load()
        except BaseException:
            self._dir_lock = None
            f.close()
            raise

    # ---- internals --------------------------------------------------------
    def _append(self, rec: Record) -> None:
        self._records.append(rec)
        self._tokens += len(rec.tokens)
        self._tenant_tokens[rec.tenant] = self._tenant_tokens.get(rec.tenant, 0) + len(rec.tokens)
        if len(rec.tokens):
            self._max_id = max(self._max_id, int(rec.tokens.max()))

    def _evict(self, tenant: str) -> tuple[int, int]:
        """Drop ``tenant``'s oldest records (only its own) down to 90% of the bound once it is over it; its newest
        record always stays (cut to its last ``max_tokens`` tokens where it alone is over the bound: a store loaded
        with a smaller bound than it was written with). Returns (records, tokens) dropped."""
        newest = next((r for r in reversed(self._records) if r.tenant == tenant), None)
        return self._drop_oldest(tenant, self.max_tokens, newest)

    def _evict_total(self, keep: Record | None = None) -> tuple[int, int]:
        """Drop the oldest records of any tenant down to 90% of ``max_total_tokens`` once the store is over it (``keep``,
        the request just added, stays; cut to the bound's last tokens if it alone is over). Returns (records, tokens)
        dropped."""
        return self._drop_oldest(None, self.max_total_tokens, keep)

    def _drop_oldest(self, tenant: str | None, bound: int, keep: Record | None) -> tuple[int, int]:
        """The eviction of :meth:`_evict` (``tenant``'s records) and :meth:`_evict_total` (everyone's, ``tenant`` None):
        once the records counted hold more than ``bound`` tokens, drop the oldest of them down to 90% of it; ``keep``
        stays, cut to its last ``bound`` tokens where it alone is over. A tenant left with nothing is forgotten; the
        indices of the tenants touched are rebuilt lazily. O(records), amortised: the next eviction is >= 10% of the
        bound away. Returns (records, tokens) dropped."""
        have = self._tokens if tenant is None else self._tenant_tokens.get(tenant, 0)
        if have <= bound:
            return 0, 0
        low = int(bound * 0.9)
        kept: deque[Record] = deque()
        dropped = lost = 0
        touched: set[str] = set()
        for r in self._records:
            n = len(r.tokens)
            if (tenant is None or r.tenant == tenant) and r is not keep and have > low:
                gone, dropped = n, dropped + 1
            elif r is keep and n > bound:
                gone = n - bound
                kept.append(Record(r.seq, r.tenant, r.tokens[gone:]))
            else:
                kept.append(r)
                continue
            have, lost, self._tokens = have - gone, lost + gone, self._tokens - gone
            self._tenant_tokens[r.tenant] -= gone
            if not self._tenant_tokens[r.tenant]:
                del self._tenant_tokens[r.tenant]
            touched.add(r.tenant)
        self._records = kept
        for t in {SHARED} if self.share else touched:
            self._indices.pop(t, None)  # rebuilt lazily from what is left
        return dropped, lost

    def _snapshot(self) -> None:
        assert self.path is not None
        tmp, snap = self.path / "snapshot.tmp", self.path / "snapshot.bin"
        with open(tmp, "wb") as f:
            f.write(snapshot_header(self._seq))
            f.writelines(encode_record(r.seq, r.tenant, r.tokens) for r in self._records)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, snap)
        _fsync_dir(self.path)
        # the snapshot now holds everything up to self._seq: empty the log in place (the file stays open, so a failure
        # here leaves a log that still takes records; a crash leaves records the load skips as the snapshot's)
        if self._log is None:
            self._log = open(self.path / "log.bin", "ab")
            _fsync_dir(self.path)
        self._log.flush()
        os.ftruncate(self._log.fileno(), 0)
        os.fsync(self._log.fileno())
        self._since_snapshot = 0

    def _load(self) -> None:
        assert self.path is not None  # (the directory exists: _open made it)
        snap, log = self.path / "snapshot.bin", self.path / "log.bin"
        recs: list[Record] = []
        damaged, last_snap = False, 0
        bad_files: list[Path] = []  # copied aside before the clean rewrite: what could not be read is not destroyed
        for f in (snap, log):
            if f.exists() and not f.is_file():
                raise ValueError(
                    f"suffix store {f} is not a regular file (a directory or a device?): move it aside, or give "
                    "another --suffix-store directory"
                )
        if snap.is_file():
            data = snap.read_bytes()
            head = read_snapshot_header(data)
            if head is not None:
                last_snap, start, ok = head
                recs, damaged = decode_records(data, str(snap), start)
                top = max((r.seq for r in recs), default=0)
                if not ok or last_snap < top or last_snap >= _MAX_SEQ:
                    # its records' largest number: a snapshot holds every live record, its newest included
                    warnings.warn(
                        f"suffix store {snap}: its header's last sequence number ({last_snap}) is damaged; taking "
                        f"its records' largest ({top}) instead",
                        stacklevel=2,
                    )
                    last_snap, damaged = top, True
            else:
                warnings.warn(
                    f"suffix store {snap}: bad snapshot header at byte offset 0; trying its records anyway",
                    stacklevel=2,
                )
                recs, damaged = decode_records(data, str(snap), 0)
                last_snap = max((r.seq for r in recs), default=0)  # (as for a damaged number above)
                damaged = True
            if damaged:
                bad_files.append(snap)
        if log.is_file():
            more, bad = decode_records(log.read_bytes(), str(log))
            damaged |= bad
            recs.extend(r for r in more if r.seq > last_snap)
            if bad:
                bad_files.append(log)
        for f in bad_files:
            keep = f.with_name(f.name + ".damaged")
            try:
                shutil.copyfile(f, keep)
                warnings.warn(f"suffix store {f}: the damaged file as it was is kept at {keep}", stacklevel=2)
            except OSError as e:
                warnings.warn(f"suffix store {f}: could not keep a copy of the damaged file ({e})", stacklevel=2)
        seen: set[int] = set()
        for r in sorted(recs, key=lambda r: r.seq):
            if r.seq not in seen:
                seen.add(r.seq)
                self._append(r)
        self._seq = max([last_snap, *seen]) if seen else last_snap
        if damaged or not log.is_file():
            self._snapshot()  # rewrite clean files (what could be read, all of it) so damage is reported once
        else:
            self._log = open(log, "ab")
        cut = [self._evict(t) for t in list(self._tenant_tokens)]  # a smaller bound than it was written with
        cut.append(self._evict_total(self._records[-1] if self._records else None))
        evicted = sum(n for n, _ in cut), sum(k for _, k in cut)
        if evicted != (0, 0):
            warnings.warn(
                f"suffix store {self.path}: {evicted[1]} tokens ({evicted[0]} whole records) over the bound of "
                f"{self.max_tokens} tokens per tenant (--suffix-max-tokens) or {self.max_total_tokens} in all "
                "(--suffix-max-total-tokens) were evicted, oldest first, and are gone from the store at its next write; "
                "open it with its earlier bounds to keep them",
                stacklevel=2,
            )
            # not written here: a store refused right after loading (one of another tokenizer) stays as it was on
            # disk; the first add writes what is kept
            self._since_snapshot = self.snapshot_every


def snapshot_header(last_seq: int) -> bytes:
    """A snapshot's header: magic, the last sequence number it holds, the checksum of both."""
    body = _SNAP_HEAD_V1.pack(_SNAP_MAGIC, last_seq)  # (the first header's layout, then its checksum)
    return body + struct.pack("<I", zlib.crc32(body))


def read_snapshot_header(data: bytes) -> tuple[int, int, bool] | None:
    """(last seq, offset of the first record, whether the header checks out) of a snapshot file's bytes; None when
    neither header's magic is there."""
    if len(data) >= _SNAP_HEAD.size and data[:8] == _SNAP_MAGIC:
        _, last, crc = _SNAP_HEAD.unpack_from(data, 0)
        return last, _SNAP_HEAD.size, zlib.crc32(data[:16]) == crc
    if len(data) >= _SNAP_HEAD_V1.size and data[:8] == _SNAP_MAGIC_V1:  # written before session 44: no checksum
        return _SNAP_HEAD_V1.unpack_from(data, 0)[1], _SNAP_HEAD_V1.size, True
    return None


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of a tokenizer's vocabulary (every id's token, in id order): what :meth:`SuffixStore.bind_tokenizer`
    compares. Models sharing a tokenizer share it (a store may serve a family's models); "" when ``tokenizer`` has no
    Hugging Face tokenizer to read (the store is then tied to the vocabulary size alone)."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        return ""
    toks = hf.convert_ids_to_tokens(list(range(len(hf))))
    h = hashlib.sha256()
    for tok in toks:
        h.update((tok if isinstance(tok, str) else repr(tok)).encode("utf-8", "surrogatepass") + b"\x00")
    return f"{len(toks)}:{h.hexdigest()[:32]}"

"""Draft tokens for speculative decoding without a draft model: prompt lookup.

A request's next tokens often repeat its context (an edited document, code being refactored, a quoted
passage). `prompt_lookup` finds the most recent earlier occurrence of the context's last n tokens (n from
`ngram_max` down to `ngram_min`) and proposes the tokens that followed it. The engine feeds the last
sampled token and the drafts in one forward, samples every position as plain decoding would (same
sampler, same order), keeps the drafts up to the first one that differs from what was sampled, and
rewinds the KV past the rest: the output is exactly that of plain decoding, greedy or sampled.

`NgramIndex` answers the same lookup incrementally (each token is indexed once, as it joins the context;
a lookup is O(ngram_max)), so a speculating request pays no per-step work proportional to its context.
`DraftControl` keeps a request's draft length where it pays: drafts grow while they are accepted and
shrink (down to none, with a retry now and then) while they are not, so a workload without repetition
pays for almost no verification. It also says when a match is worth stopping a chain of decode runs for
(`stop_chain`); on CUDA, where such a stop costs the device a host round trip, a request that is not
copying stops only for a match that proved right about the next token, so a chance match (common words
repeating) costs one short run instead of a broken chain, and the drafts after such a stop come from the
confirmed match or from a match longer than the lookup's n-grams, not from a chance match the run behind
the stop brought.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnxgen.package.attachments import KEY_BASE

MODES = ("prompt_lookup",)


def prompt_lookup(tokens: Sequence[int], k: int, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the last n tokens of `tokens`
    (the longest n in [ngram_min, ngram_max] that occurs), or [] when none occurs."""
    n_tok = len(tokens)
    if k <= 0 or n_tok < ngram_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(ngram_max, n_tok - 1), ngram_min - 1, -1):
        tail = arr[n_tok - n :]
        # starts i of earlier windows arr[i : i + n] equal to the tail, with at least one token after them
        cand = np.flatnonzero(arr[: n_tok - n] == tail[0])
        for j in range(1, n):
            cand = cand[arr[cand + j] == tail[j]]
        if cand.size:
            start = int(cand[-1]) + n  # the most recent occurrence
            return arr[start : start + k].tolist()
    return []


class NgramIndex:
    """`prompt_lookup` over a growing token sequence, incrementally: for every n-gram (n in [ngram_min,
    ngram_max]) that has a token after it, the position of that token at its most recent occurrence.

    The first piece (a request's prompt, possibly thousands of tokens) is indexed in bulk with numpy when it
    has at least `bulk_min` tokens: per n, the n-grams encoded as integers, sorted, with the position after
    each one's last occurrence (searched by bisection). Later pieces (the samples, a few at a time) go into
    a dict; its entries are more recent than any bulk entry, so a lookup asks the dict first."""

    _BITS = 21  # bits per token in a bulk key: n-grams of up to 3 tokens below 2**21 fit in an int64

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1, bulk_min: int = 256) -> None:
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.bulk_min = bulk_min
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}
        self._bulk: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # n -> (sorted keys, position after)

    @property
    def bulk_indexed(self) -> bool:
        """Whether the first piece went into the bulk (numpy) index."""
        return bool(self._bulk)

    def extend(self, new: Sequence[int]) -> None:
        """Append `new`: the n-grams ending just before each appended token now have a follower."""
        if not self.tokens and len(new) >= max(1, self.bulk_min) and self._index_bulk(new):
            return
        toks, nxt = self.tokens, self._next
        for t in new:
            pos = len(toks)
            for n in range(self.ngram_min, min(self.ngram_max, pos) + 1):
                nxt[tuple(toks[pos - n : pos])] = pos
            toks.append(t)

    def _index_bulk(self, new: Sequence[int]) -> bool:
        """Index the first piece with numpy; False (nothing done) when its n-grams do not fit the keys."""
        arr = np.asarray(new, dtype=np.int64)
        if self.ngram_max > 3 or int(arr.min()) < 0 or int(arr.max()) >= 1 << self._BITS:
            return False
        size = len(arr)
        for n in range(self.ngram_min, self.ngram_max + 1):
            m = size - n  # windows arr[i : i + n] with a follower at i + n < size
            if m <= 0:
                continue
            keys = np.zeros(m, dtype=np.int64)
            for j in range(n):
                keys |= arr[j : j + m] << (self._BITS * j)
            order = np.argsort(keys)
            ks = keys[order]
            starts = np.flatnonzero(np.concatenate(([True], ks[1:] != ks[:-1])))
            self._bulk[n] = (ks[starts], np.maximum.reduceat(order, starts) + n)  # each key's latest window
        self.tokens = arr.tolist()
        return True

    def _bulk_get(self, tail: Sequence[int]) -> int | None:
        found = self._bulk.get(len(tail))
        if found is None or min(tail) < 0 or max(tail) >= 1 << self._BITS:
            return None
        keys, after = found
        key = 0
        for j, t in enumerate(tail):
            key |= t << (self._BITS * j)
        i = int(np.searchsorted(keys, key))
        return int(after[i]) if i < len(keys) and int(keys[i]) == key else None

    def lookup(self, k: int) -> list[int]:
        """What `prompt_lookup(self.tokens, k, ngram_max, ngram_min)` returns."""
        pos = self.source()
        return self.tokens[pos : pos + k] if pos is not None and k > 0 else []

    def match_length(self, src: int, limit: int) -> int:
        """How many of the tokens before position `src` equal the sequence's last tokens (read backwards from
        `src - 1` and from the end), at most `limit`: how long the match behind a `source` really is (the
        lookup itself sees at most `ngram_max` tokens of it)."""
        toks, end = self.tokens, len(self.tokens)
        n = 0
        while n < limit and src - 1 - n >= 0 and toks[src - 1 - n] == toks[end - 1 - n]:
            n += 1
        return n

    def source(self) -> int | None:
        """Where `lookup`'s tokens start in `tokens` (the position after the most recent earlier occurrence of
        the longest tail n-gram that has one), or None when no tail n-gram occurred before."""
        toks = self.tokens
        if len(toks) < self.ngram_min + 1:
            return None
        for n in range(min(self.ngram_max, len(toks) - 1), self.ngram_min - 1, -1):
            tail = toks[len(toks) - n :]
            pos = self._next.get(tuple(tail))
            if pos is None and self._bulk:
                pos = self._bulk_get(tail)
            if pos is not None:
                return pos
        return None


class DraftControl:
    """A request's draft length: starts at `k`, doubles after a fully accepted draft (up to `k_max`), halves
    after a draft with nothing accepted. At 0 it lets `cooldown` tokens of output pass (counted in tokens,
    not steps: a run of decode steps makes many at once), then tries 1 again; each retry rejected doubles
    the wait up to `cooldown_max` (default: no growth), an accepted draft resets it. So a copy ramps up to
    `k_max` drafts in a few steps, and text with nothing to copy pays about one rejected one-token draft per
    `cooldown_max` tokens (what CUDA sets: there a verify step breaks a run of decode steps). `confirm`: a
    request that is not `hot` stops a chain of decode runs only for a confirmed match (`stop_chain`);
    `follow`: the drafts after such a stop come from that match or a longer one (`propose`)."""

    HOT_TOKENS = 32  # a request is `hot` for this many output tokens after a draft of it was accepted

    def __init__(
        self,
        k: int = 4,
        k_max: int = 8,
        cooldown: int = 16,
        cooldown_max: int | None = None,
        ngram_min: int = 1,
        sizes: tuple[int, ...] = (),
        confirm: bool = False,
        follow: bool = False,
        solo: bool = False,
    ) -> None:
        self.solo = solo  # drafts only while the request runs alone (`active`)
        self.confirm = confirm  # `stop_chain` waits for a match to be confirmed unless `hot`
        # with `confirm`: after a stop for a confirmed match, draft only its continuation or a longer match
        # (`propose`)
        self.follow = follow
        # `stop_chain`'s unconfirmed match: (output length then, the token it proposed, its source in the
        # context: the position that token was copied from)
        self._guess: tuple[int, int, int] | None = None
        self._copy: tuple[int, int] | None = (
            None  # a confirmed stop's match: (context length, source) at a time
        )
        self._accepted_at: int | None = None  # the output length after the last draft with tokens accepted
        self.k = k
        self.k_max = k_max
        self.sizes = tuple(sorted(sizes))
        self.cooldown = cooldown
        self.cooldown_max = cooldown if cooldown_max is None else cooldown_max
        self._wait = cooldown  # the next wait once k falls to 0
        self._resume = 0  # with k at 0: the output length from which a draft is tried again
        self.drafted = 0
        self.accepted = 0
        self._index = NgramIndex(ngram_min=ngram_min)  # (a longer shortest match: fewer, surer drafts)
        self._seen = 0  # of the request's prompt + output, the tokens already in the index

    def propose(self, prompt: Sequence[int], output: Sequence[int], k: int) -> list[int]:
        """Up to `k` drafts for the context `prompt + output` (append-only across calls: a request's
        prompt never changes and its output only grows), indexing only what is new since the last call.
        With `follow`, the first call after `stop_chain` stopped for a confirmed match drafts that match's
        continuation, and none when the lookup now answers from another source whose match is no longer
        than the lookup's n-grams (a chance match in the context the run behind the stop left, not the copy
        that was confirmed); a longer match there (the copy resumed from a more recent occurrence: a list
        that repeats with a changed period) is drafted."""
        src = self._source(prompt, output)
        copy, self._copy = self._copy, None
        if src is None or k <= 0:
            return []
        if copy is not None and src != copy[1] + (self._seen - copy[0]):
            reach = self._index.ngram_max
            if self._index.match_length(src, reach + 1) <= reach:
                return []
        drafts = self._index.tokens[src : src + k]
        for i, t in enumerate(drafts):
            if t >= KEY_BASE:  # an image's token is never a draft (no sample can equal it)
                return drafts[:i]
        return drafts

    def _source(self, prompt: Sequence[int], output: Sequence[int]) -> int | None:
        """Index what is new of the context `prompt + output` and return where the lookup's drafts start in it
        (`NgramIndex.source`; None: no match)."""
        lp = len(prompt)
        if self._seen < lp:
            self._index.extend(prompt[self._seen :])
            self._seen = lp
        if self._seen < lp + len(output):
            self._index.extend(output[self._seen - lp :])
            self._seen = lp + len(output)
        return self._index.source()

    def budget(self, generated: int) -> int:
        """How many drafts to propose at this point of the output (`generated` tokens; 0: a plain step):
        the draft length, raised to fill the verify size it falls in (`sizes`: a verify of n positions
        costs as the smallest size >= n, so k drafts, k + 1 positions, may as well be size - 1), at most
        `k_max`."""
        k = self.k if self.k > 0 else (1 if generated >= self._resume else 0)
        if k > 0:
            k = min(self.k_max, next((s - 1 for s in self.sizes if s >= k + 1), k))
        return k

    def stop_chain(self, prompt: Sequence[int], output: Sequence[int]) -> bool:
        """On reading a run of a chain of decode steps (`output`: every token read so far; the runs launched
        behind it not yet): whether to stop the chain so that a step verifies drafts. Without `confirm`:
        whenever the request would draft now (a budget and a match in its context). With it, such a request
        stops at once only while `hot`; otherwise
        only when the match seen at its previous call was right about the token that followed it (that
        token is read by now), and else the match's first token is kept for the next call to check
        (`watching` holds meanwhile). Why: a chain's runs are read one behind the launches, so a stop costs
        the device a host round trip and the drafts come from a context a run later than this one, where a
        chance match (common words repeating: most matches in text with nothing to copy) is gone and the
        stop bought nothing. Stopping or not, the output is plain decoding's."""
        n = len(output)
        guess, self._guess = self._guess, None
        self._copy = None
        src = self._source(prompt, output) if self.budget(n) > 0 else None
        if src is None:
            return False
        if not self.confirm or self.hot(n):
            return True
        if guess is not None and guess[0] < n and output[guess[0]] == guess[1]:  # the last match was right
            if self.follow:
                self._copy = (len(prompt) + guess[0], guess[2])
            return True
        self._guess = (n, self._index.tokens[src], src)
        return False

    def active(self, batch: int) -> bool:
        """Whether the request drafts (and shortens runs, stops chains for drafts) in a step of `batch`
        requests: always, or with `solo` only alone — CUDA's setting (`Engine.speculate_alone`), where a verify
        step beside other requests' decodes runs eagerly, outside their captured decode runs."""
        return batch == 1 or not self.solo

    def watching(self, generated: int) -> bool:
        """`hot`, or a match that `stop_chain` saw waits for the next run to confirm it: what keeps runs of
        decode steps short (`Engine.spec_decode_steps`), so that a copy starting there is verified soon."""
        return self._guess is not None or self.hot(generated)

    def hot(self, generated: int) -> bool:
        """Whether a draft was accepted within the last `HOT_TOKENS` of `generated` output tokens: the request
        is copying, and more matches are likely soon (what shortens runs of decode steps on CUDA, so they are
        verified sooner; a request that never had a draft accepted keeps full runs)."""
        return self._accepted_at is not None and generated - self._accepted_at < self.HOT_TOKENS

    def update(self, proposed: int, accepted: int, generated: int) -> None:
        """After verifying `proposed` drafts of which the first `accepted` were kept, with `generated`
        tokens of output (the accepted ones included)."""
        self.drafted += proposed
        self.accepted += accepted
        if proposed == 0:
            return
        self._guess = None  # a verify step decides for itself (a guess belongs to a chain of decode runs)
        self._copy = None
        if accepted:
            self._wait = self.cooldown
            self._accepted_at = generated
        if accepted == proposed:
            self.k = min(self.k_max, 2 * max(self.k, proposed))
        elif accepted == 0:
            self.k //= 2
            if self.k == 0:
                self._resume = generated + self._wait
                self._wait = min(self.cooldown_max, 2 * self._wait)


def draft_control(cuda: bool, sizes: tuple[int, ...] = (), solo: bool = False) -> DraftControl:
    """A new request's control; `sizes`: the runner's verify sizes (`BatchRunner.verify_sizes`: draft
    lengths are raised to fill them). On CUDA a verify step of up to 16 positions replays one graph (so up
    to 15 drafts), but it breaks a run of decode steps (the device waits for the host): drafts need a match
    of 2 tokens or more (a one-token match's odds cost more there than on the CPU), the wait after
    rejected retries doubles up to 256 tokens, and a request that is not copying stops a chain of decode
    runs only for a confirmed match (`confirm`) and, after such a stop, drafts only along that match or a
    longer one (`follow`; on the CPU a stop costs little, and a copy found a run later costs decode
    steps). On the CPU the plain settings measured best (docs/benchmarks/speculative.md). `solo`: drafts only
    while the request runs alone (`DraftControl.active`)."""
    if cuda:
        return DraftControl(
            k_max=15,
            ngram_min=2,
            cooldown_max=256,
            sizes=sizes,
            confirm=True,
            follow=True,
            solo=solo,
        )
    return DraftControl(sizes=sizes, solo=solo)

"""A model of the persistent kernel's ring protocol (cpp/src/cuda/attn_res_persistent.cuh: produce_rows and the
consumer loop's cursors, waits and releases), for checking a change to the protocol without a GPU:

    python3 tools/persistent_ring_model.py [seeds]

It models the protocol only, not the arithmetic; keep it in step with the kernel. One producer, W consumer
warps, bulk copies landing after random delays, mbarriers with phase-parity semantics and a grid dependency
that resolves at a random moment, all under random interleavings. Checks: no deadlock; every consumer read
sees the row it expects, landed; no copy overwrites a slot a warp may still read; every parity wait matches
exactly the phase it means (never one a lap away); before the grid dependency resolves, only bank rows
0..K-2 are copied and no wait depends on the consumers; a two-pass token with addends mixes from the `updated` row,
copied back only after every consumer warp stored its part (named barrier 2), and no copy reads the prefix after
a warp stored `updated` (so the update may be in place)."""

import random
import sys


class MBarrier:
    def __init__(self, count):
        self.count = count
        self.pending = count
        self.tx = 0
        self.completed = 0  # phases completed

    def arrive(self):
        self.pending -= 1
        self._check()

    def expect_tx(self, b):
        self.tx += b
        self.pending -= 1
        self._check()

    def complete_tx(self, b):
        self.tx -= b
        self._check()

    def _check(self):
        assert self.pending >= 0
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = self.count

    def try_wait_parity(self, parity):
        # true iff the current (incomplete) phase's parity differs from `parity`
        return (self.completed & 1) != parity


class Ring:
    def __init__(self, S, W):
        self.S = S
        self.full = [MBarrier(1) for _ in range(S)]
        self.empty = [MBarrier(W) for _ in range(S)]
        self.content = [None] * S  # (token, pass, r) of the latest copy issued into the slot
        self.landed = [True] * S
        self.readers = [set() for _ in range(S)]  # warps that may still read the slot (acquired, not released)
        self.inflight = []  # (slot, row_id)


def run(T, K, adds, S, W, grid, block, passes, seed, sync_updated=True):
    """adds: the addends (0, 1, 2); sync_updated=False drops the producer's sync on barrier 2 (a broken protocol
    the checks must catch)."""
    rng = random.Random(seed)
    ring = Ring(S, W)
    waited = [False]
    dep = [False]
    log = []
    stored = {}  # token -> consumer warps that stored (and fenced) their part of `updated`
    arrivals = {"count": 0, "gen": 0}  # named barrier 2: W consumer arrivals (+ the producer's sync) per phase

    def wait_full(slot, phase, expect, warp, expected_completions):
        while not ring.full[slot].try_wait_parity(phase):
            yield
        # the phase we waited for must be the one just completed, not one a lap later
        assert ring.full[slot].completed == expected_completions, (slot, ring.full[slot].completed, expected_completions)
        assert ring.landed[slot] and ring.content[slot] == expect, (slot, ring.content[slot], expect)
        ring.readers[slot].add(warp)

    def producer():
        slot, phase, lap = 0, 0, [0] * S
        issued = 0
        for t in range(block, T, grid):
            for ps in range(passes):
                mix_updated = ps == 1 and adds > 0
                for r in range(K + 1 if mix_updated else K + 1 + adds):
                    if mix_updated and r == K:  # bar.sync 2: every consumer warp arrived for this token
                        while sync_updated and arrivals["count"] < W:
                            yield
                        arrivals["count"] -= W
                        arrivals["gen"] += 1
                        assert stored.get(t) == set(range(W)), ("updated copied before it was stored", t, stored.get(t))
                    if r == K and not mix_updated:
                        assert not stored.get(t), ("the prefix read after `updated` was written", t)
                    if not waited[0] and (r >= K - 1 or issued == S):
                        while not dep[0]:  # griddepcontrol.wait: resolves when the previous grid completes
                            yield
                        waited[0] = True
                    issued += 1
                    if not waited[0]:
                        assert r < K - 1, "a row other than bank 0..K-2 before griddepcontrol.wait"
                    while not ring.empty[slot].try_wait_parity(phase ^ 1):
                        assert waited[0], "a wait for a released slot before the grid dependency resolved"
                        yield
                    # every warp has released the slot's previous content
                    assert ring.empty[slot].completed == lap[slot], (slot, ring.empty[slot].completed, lap[slot])
                    assert not ring.readers[slot], ("overwrite while read", slot, ring.readers[slot])
                    ring.full[slot].expect_tx(1)
                    ring.content[slot] = (t, ps, "updated" if mix_updated and r == K else r)
                    ring.landed[slot] = False
                    ring.inflight.append(slot)
                    lap[slot] += 1
                    slot += 1
                    if slot == S:
                        slot, phase = 0, phase ^ 1
                    yield
        while not dep[0]:
            yield
        waited[0] = True

    barrier = {"count": 0, "gen": 0}

    def consumer_barrier():
        gen = barrier["gen"]
        barrier["count"] += 1
        if barrier["count"] == W:
            barrier["count"] = 0
            barrier["gen"] += 1
        while barrier["gen"] == gen:
            yield

    def release(slot, warp):
        ring.readers[slot].discard(warp)
        ring.empty[slot].arrive()

    def consumer(warp):
        while not dep[0]:  # the consumer's own griddepcontrol.wait
            yield
        cur = [0, 0]
        uses = [0] * S  # how many times this warp has waited on each slot's full barrier

        def adv(c):
            c[0] += 1
            if c[0] == S:
                c[0], c[1] = 0, c[1] ^ 1

        two = passes == 2
        for t in range(block, T, grid):
            first = list(cur)
            for n in range(K):
                s, ph = cur
                uses[s] += 1
                yield from wait_full(s, ph, (t, 0, n), warp, uses[s])
                if two:
                    release(s, warp)
                adv(cur)
            tail = []
            for i in range(1 + adds):  # the prefix, then the addends
                tail.append(list(cur))
                adv(cur)
            for i, (s, ph) in enumerate(tail):
                uses[s] += 1
                yield from wait_full(s, ph, (t, 0, K + i), warp, uses[s])
            log.append(("scored", t, warp))
            if adds:  # stores its part of `updated`
                stored.setdefault(t, set()).add(warp)
            if two and adds:
                # fence.proxy.async.global, then bar.arrive 2; a warp arrives for token t + grid only after
                # the producer's sync for t (it needs rows issued after it)
                assert arrivals["count"] < W, "a second phase's arrival before the producer synced"
                arrivals["count"] += 1
            if two:
                for s, _ in tail:
                    release(s, warp)
            yield from consumer_barrier()
            mix = list(cur) if two else list(first)
            for n in range(K):
                s, ph = mix
                if two:
                    uses[s] += 1
                    yield from wait_full(s, ph, (t, 1, n), warp, uses[s])
                else:
                    assert ring.content[s] == (t, 0, n) and warp in ring.readers[s]
                release(s, warp)
                adv(mix)
                yield
            tail = []
            for i in range(1 if two and adds else 1 + adds):  # two passes with addends: the `updated` row
                tail.append(list(mix))
                adv(mix)
            for i, (s, ph) in enumerate(tail):
                want = (t, 1, "updated") if two and adds else (t, 1 if two else 0, K + i)
                if two:
                    uses[s] += 1
                    yield from wait_full(s, ph, want, warp, uses[s])
                else:
                    assert ring.content[s] == want and warp in ring.readers[s]
            for s, _ in tail:
                release(s, warp)
            if two:
                cur = mix
            yield from consumer_barrier()
            log.append(("output", t, warp))

    agents = [producer()] + [consumer(w) for w in range(W)]
    alive = list(range(len(agents)))
    steps = 0
    while alive or ring.inflight:
        steps += 1
        if steps > 2_000_000:
            raise AssertionError("deadlock / livelock")
        if not dep[0] and rng.random() < 0.01:
            dep[0] = True
        if ring.inflight and (not alive or rng.random() < 0.3):
            i = rng.randrange(len(ring.inflight))
            slot = ring.inflight.pop(i)
            ring.landed[slot] = True
            ring.full[slot].complete_tx(1)
            continue
        if not alive:
            continue
        a = rng.choice(alive)
        try:
            next(agents[a])
        except StopIteration:
            alive.remove(a)
    tokens = list(range(block, T, grid))
    assert sorted(x[1] for x in log if x[0] == "output") == sorted(t for t in tokens for _ in range(W))


def run_seeds(seeds, **kw):
    """Every block of one random configuration per seed; the number of runs."""
    n = 0
    for seed in seeds:
        rng = random.Random(seed)
        K = rng.randrange(0, 16)
        adds = rng.randrange(0, 3)
        rows = K + 1 + adds
        least = 3 if adds == 2 else 2  # tuning::persistent_min_slots
        W = rng.randrange(1, 9)
        if rng.random() < 0.5:
            S = rng.randrange(max(rows, least), rows + 8)
            passes = 1
        else:  # two passes: forced by the tuning knob over any depth, or chosen when a token does not fit
            S = rng.randrange(least, 8) if rng.random() < 0.5 else rng.randrange(least, rows + 8)
            passes = 2
        T = rng.randrange(1, 12)
        grid = rng.randrange(1, 5)
        for block in range(min(grid, T)):
            run(T, K, adds, S, W, grid, block, passes, seed * 7 + block, **kw)
            n += 1
    return n


def main():
    print("ok", run_seeds(range(int(sys.argv[1]) if len(sys.argv) > 1 else 300)), "runs")


if __name__ == "__main__":
    main()

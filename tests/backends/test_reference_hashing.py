"""The reference's one splitmix64 on each of its three representations, against the golden vectors of
docs/semantics.md: a uint64 numpy array, a plain Python int (one lane) and 64-bit values packed at a 128-bit
stride in one Python int (the write's lock-step chains), whose high halves may hold junk in their top
31 bits (what the previous call leaves there)."""
from __future__ import annotations

import random

import numpy as np
from support.oracle import sm64
from support.trees import load_vectors

from kv_canary.backends.reference import MASK64, link_values, run_chains, serial_chain, splitmix64

VECTORS = [(int(v["in"], 16), int(v["out"], 16)) for v in load_vectors()["splitmix64"]]


def test_numpy_arrays_hash_in_place():
    ins = np.array([i for i, _ in VECTORS], dtype=np.uint64)
    out = splitmix64(ins)
    assert out is ins
    assert out.tolist() == [o for _, o in VECTORS]


def test_one_lane_is_a_plain_int():
    for i, o in VECTORS:
        assert splitmix64(i, MASK64) == o


def test_packed_lanes_ignore_junk_in_their_high_halves():
    rng = random.Random(0)
    lanes = sum(MASK64 << (128 * k) for k in range(len(VECTORS)))
    for rounds in (1, 3):  # junk from earlier rounds' shifts must never reach a low half
        x = sum((i | rng.getrandbits(31) << 97) << (128 * k) for k, (i, _) in enumerate(VECTORS))
        want = [i for i, _ in VECTORS]
        for _ in range(rounds):
            x = splitmix64(x, lanes)
            want = [sm64(w) for w in want]
        assert [(x >> (128 * k)) & MASK64 for k in range(len(VECTORS))] == want


def test_the_lock_step_chains_equal_one_chain_at_a_time():
    rng = np.random.default_rng(0)
    lens = np.array([5, 0, 1, 7, 7, 2], dtype=np.int64)
    seeds = rng.integers(0, 1 << 63, lens.size).astype(np.uint64)
    fold = [rng.integers(0, 1 << 63, int(lens.sum())).astype(np.uint64) for _ in range(3)]
    got = run_chains(lens, seeds, np.full(lens.size, -1, dtype=np.int64), fold)
    want, at = [], 0
    for n, seed in zip(lens.tolist(), seeds.tolist()):
        chain = serial_chain(seed, [v[at:at + n].tolist() for v in fold])
        run = seed
        for k in range(n):  # the same chain through the vector link, one entry at a time
            assert chain[k] == run
            run = int(link_values(np.array([run], dtype=np.uint64), [v[at + k: at + k + 1] for v in fold])[0])
        want += chain
        at += n
    assert got.tolist() == want

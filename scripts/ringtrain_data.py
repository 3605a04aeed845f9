"""ringtrain's built-in data path in Python: the ChaCha8 stream, the `synthetic` corpus and the window
sampler, so that a PyTorch run can train on exactly the batches a ringtrain run sees.

The rules come from the Rust sources' documentation: `src/data/rng.rs` (ChaCha8 keyed by tag ‖ a ‖ b,
rejection sampling, Fisher–Yates), `src/data/synthetic.rs` (the story grammar) and `src/data/sampler.rs`
(window j is tokens [j·T, j·T + T + 1); step s takes positions [s·G, (s+1)·G) of the epoch's order).
`python3 scripts/ringtrain_data.py` checks this file against the pinned values in `tests/data.rs`.

Needs numpy only.
"""
import numpy as np

_MASK64 = (1 << 64) - 1
_SIGMA = np.frombuffer(b"expand 32-byte k", dtype="<u4")


def _rotl(x, n):
    return (x << np.uint32(n)) | (x >> np.uint32(32 - n))


def _chacha8_blocks(key_words, first_block, n_blocks):
    """Keystream blocks `first_block ..` of ChaCha8 (64-bit block counter, stream 0), as u32 words in
    output order: [n_blocks * 16]."""
    counters = np.arange(first_block, first_block + n_blocks, dtype=np.uint64)
    # init: [16, n_blocks]
    init = np.zeros((16, n_blocks), dtype=np.uint32)
    init[0:4] = _SIGMA[:, None]
    init[4:12] = np.asarray(key_words, dtype=np.uint32)[:, None]
    init[12] = (counters & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    init[13] = (counters >> np.uint64(32)).astype(np.uint32)
    x = [init[i].copy() for i in range(16)]

    def quarter(a, b, c, d):
        x[a] += x[b]
        x[d] = _rotl(x[d] ^ x[a], 16)
        x[c] += x[d]
        x[b] = _rotl(x[b] ^ x[c], 12)
        x[a] += x[b]
        x[d] = _rotl(x[d] ^ x[a], 8)
        x[c] += x[d]
        x[b] = _rotl(x[b] ^ x[c], 7)

    with np.errstate(over="ignore"):
        for _ in range(4):  # 8 rounds = 4 double rounds
            quarter(0, 4, 8, 12)
            quarter(1, 5, 9, 13)
            quarter(2, 6, 10, 14)
            quarter(3, 7, 11, 15)
            quarter(0, 5, 10, 15)
            quarter(1, 6, 11, 12)
            quarter(2, 7, 8, 13)
            quarter(3, 4, 9, 14)
        out = np.stack(x) + init
    return out.T.reshape(-1)


class ChaCha8:
    """rand_chacha's ChaCha8Rng from a 32-byte seed: `next_u64` joins two consecutive u32 words, low first."""

    CHUNK_BLOCKS = 1024

    def __init__(self, seed32):
        assert len(seed32) == 32
        self._key = np.frombuffer(bytes(seed32), dtype="<u4").copy()
        self._next_block = 0
        self._words = []
        self._pos = 0

    def _refill(self):
        words = _chacha8_blocks(self._key, self._next_block, self.CHUNK_BLOCKS)
        self._next_block += self.CHUNK_BLOCKS
        self._words = [int(w) for w in words]
        self._pos = 0

    def next_u64(self):
        if self._pos + 2 > len(self._words):
            self._refill()
        lo, hi = self._words[self._pos], self._words[self._pos + 1]
        self._pos += 2
        return lo | (hi << 32)


def keyed_rng(tag, a, b):
    """`rng.rs::keyed_rng`: key = tag (zero-padded/truncated to 16 bytes) ‖ a (u64 LE) ‖ b (u64 LE)."""
    key = bytes(tag[:16]).ljust(16, b"\0") + int(a).to_bytes(8, "little") + int(b).to_bytes(8, "little")
    return ChaCha8(key)


def uniform_below(rng, bound):
    """Uniform in [0, bound): rejects the 2^64 mod bound smallest words."""
    if bound <= 1:
        return 0
    reject_below = ((1 << 64) - bound) % bound
    while True:
        x = rng.next_u64()
        if x >= reject_below:
            return x % bound


def shuffle(rng, items):
    for i in range(len(items) - 1, 0, -1):
        j = uniform_below(rng, i + 1)
        items[i], items[j] = items[j], items[i]


# ------------------------------------------------------------------ the synthetic corpus

TRAIN_SEED, VAL_SEED = 1, 2
TRAIN_TARGET_BYTES, VAL_TARGET_BYTES = 1_500_000, 150_000
_ADJECTIVES = ["little", "big", "brave", "quiet", "clever", "gentle", "young", "proud"]
_ANIMALS = ["cat", "dog", "fox", "bird", "bear", "frog", "mouse", "rabbit"]
_NAMES = ["Anna", "Ben", "Clara", "David", "Emma", "Felix", "Grace", "Henry"]
_VERBS = ["sees", "finds", "likes", "chases", "carries", "wants", "paints", "hides"]
_COLOURS = ["red", "blue", "green", "yellow", "small", "large", "shiny", "old"]
_OBJECTS = ["ball", "box", "hat", "book", "cup", "kite", "stone", "apple"]
_MOODS = ["happy", "tired", "hungry", "sleepy"]
_FRUITS = ["apples", "pears", "plums", "cherries"]


def synthetic_text(seed, target_bytes):
    """`synthetic.rs::generate`: whole stories until the text has at least `target_bytes` bytes."""
    rng = keyed_rng(b"ringtrain/synth", seed, 0)

    def pick(words):
        return words[uniform_below(rng, len(words))]

    def between(lo, hi):
        return lo + uniform_below(rng, hi - lo + 1)

    parts, size, n = [], 0, 1
    while size < target_bytes:
        adjective, animal, name = pick(_ADJECTIVES), pick(_ANIMALS), pick(_NAMES)
        lines = [f"Story {n}.", f"Once upon a time, there was a {adjective} {animal} named {name}."]
        for _ in range(between(3, 6)):
            kind = uniform_below(rng, 5)
            if kind == 0:
                verb, colour, obj = pick(_VERBS), pick(_COLOURS), pick(_OBJECTS)
                lines.append(f"The {animal} {verb} the {colour} {obj}.")
            elif kind == 1:
                lines.append(f"{name} is {pick(_MOODS)} today.")
            elif kind == 2:
                a, b, fruit = between(1, 9), between(1, 9), pick(_FRUITS)
                lines.append(f"{name} has {a} {fruit} and finds {b} more, so now {name} has {a + b} {fruit}.")
            elif kind == 3:
                k = between(1, 20)
                lines.append(f"{name} counts {k}, {k + 1}, {k + 2}, {k + 3}.")
            else:
                sun = "warm" if uniform_below(rng, 2) == 0 else "bright"
                sky = "blue" if uniform_below(rng, 2) == 0 else "grey"
                lines.append(f"The sun is {sun} and the sky is {sky}.")
        story = "\n".join(lines) + "\nThe end.\n\n"
        parts.append(story)
        size += len(story)
        n += 1
    return "".join(parts)


# ------------------------------------------------------------------ the window sampler


class WindowSampler:
    """`sampler.rs::WindowSampler` over a stream of `n_tokens` tokens, sequence length `t`, global batch `g`."""

    def __init__(self, n_tokens, t, g, shuffle_windows, seed):
        self.n_windows = (n_tokens - 1) // t if n_tokens > 0 else 0
        self.g, self.shuffle, self.seed = g, shuffle_windows, seed
        self._epoch, self._order = None, None

    def epoch_order(self, epoch):
        if not self.shuffle:
            return list(range(self.n_windows))
        if self._epoch != epoch:
            order = list(range(self.n_windows))
            shuffle(keyed_rng(b"ringtrain/shufl", self.seed, epoch), order)
            self._epoch, self._order = epoch, order
        return self._order

    def windows_for_step(self, step):
        spe = self.n_windows // self.g
        epoch, pos = divmod(step, spe)
        start = pos * self.g
        return self.epoch_order(epoch)[start : start + self.g]


def synthetic_train_tokens():
    """The synthetic training corpus as byte-tokenizer ids, int64 [len]: what `--data synthetic` trains on."""
    text = synthetic_text(TRAIN_SEED, TRAIN_TARGET_BYTES)
    return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64)


def batch(tokens, windows, t):
    """Inputs and targets [len(windows), t] of the windows, as `fill_batch` builds them."""
    inputs = np.stack([tokens[w * t : w * t + t] for w in windows])
    targets = np.stack([tokens[w * t + 1 : w * t + t + 1] for w in windows])
    return inputs, targets


def _self_check():
    # Pinned in tests/data.rs (shuffle_order_is_pinned): the windows of a 1000-window sampler, seed 1234.
    s = WindowSampler(1000 * 1 + 1, 1, 8, True, 1234)
    assert s.windows_for_step(0) == [405, 480, 301, 663, 902, 265, 130, 972], s.windows_for_step(0)
    assert s.windows_for_step(125) == [325, 260, 181, 637, 872, 612, 867, 535], s.windows_for_step(125)
    text = synthetic_text(7, 20_000)
    assert text.startswith("Story 1.\nOnce upon a time, there was a ") and text.endswith("The end.\n\n")
    assert 20_000 <= len(text) < 21_000
    print("ok: sampler order matches tests/data.rs; synthetic grammar holds")


if __name__ == "__main__":
    _self_check()

"""Write ref34.json (kernels/reference.py, q4int.py, jitcache.py, probes.py) and triton34.json
(kernels/gpu.py, triton_decode.py): each bug's text must occur once and the planted file must compile."""

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from planted_list import write_list  # noqa: E402

R, Q, J, P = (f"kvlens/kernels/{n}.py" for n in ("reference", "q4int", "jitcache", "probes"))
G, T = "kvlens/kernels/gpu.py", "kvlens/kernels/triton_decode.py"

REF = [
    ("ref-causal-excludes-self", R, "mask = k_pos[None, :] <= q_pos[:, None]", "mask = k_pos[None, :] < q_pos[:, None]"),
    ("ref-window-one-wider", R, "mask &= k_pos[None, :] > (q_pos[:, None] - window)", "mask &= k_pos[None, :] >= (q_pos[:, None] - window)"),
    ("ref-slide-first-one-late", R, "    first = length - window\n", "    first = length - window + 1\n"),
    ("ref-slide-last-partial-block-dropped", R, "np.arange(first // block, -(-length // block)", "np.arange(first // block, length // block"),
    ("ref-slide-first-block-skipped", R, "np.arange(first // block, ", "np.arange(first // block + 1, "),
    ("ref-slide-full-window-raises", R, "    if window >= length:\n        return blocks, 0\n", "    if window > length:\n        return blocks, 0\n"),
    ("ref-blocks-mask-all", R, "== blocks.long()[:, :, None]).any(dim=1)", "== blocks.long()[:, :, None]).all(dim=1)"),
    ("ref-keymask-or", R, "mask = head_mask if mask is None else mask[None] & head_mask", "mask = head_mask if mask is None else mask[None] | head_mask"),
    ("ref-scale-over-d", R, "* (1.0 / math.sqrt(d))", "* (1.0 / d)"),
    ("ref-gqa-repeat-not-interleave", R, "    k = k.to(q.dtype).repeat_interleave(group, dim=0)\n    v = v.to(q.dtype).repeat_interleave(group, dim=0)\n", "    k = k.to(q.dtype).repeat(group, 1, 1)\n    v = v.to(q.dtype).repeat(group, 1, 1)\n"),
    ("ref-no-max-shift-float32", R, "    scores = scores - scores.amax(dim=-1, keepdim=True)\n    w = torch.exp(scores)", "    w = torch.exp(scores)"),
    ("sdpa-window-single-query-sees-all", R, "if q.shape[1] == 1 and window is None:", "if q.shape[1] == 1:"),
    ("sdpa-kvmask-group-one", R, "mask = _key_mask(q_pos, k.shape[1], window, kv_mask, n_heads // n_kv)", "mask = _key_mask(q_pos, k.shape[1], window, kv_mask, 1)"),
    ("sink-state-no-shift", R, "p = torch.exp(scores - m)", "p = torch.exp(scores - m.detach() * 0)"),
    ("sink-state-sum-over-dim", R, "p.sum(dim=2).reshape(-1)", "p.amax(dim=2).reshape(-1)"),
    ("q4-permute-identity", Q, "chunks.transpose(0, 1, 3, 2, 4)", "chunks.transpose(0, 1, 2, 3, 4)"),
    ("q4-permute-swap-blocks", Q, "chunks.transpose(0, 1, 3, 2, 4)", "chunks.transpose(0, 1, 3, 2, 4)[:, :, ::-1]"),
    ("q4-lane-offset-seven", Q, "return 8 * lanes.reshape(n_heads, hd // 8)", "return 7 * lanes.reshape(n_heads, hd // 8)"),
    ("q4-lane-scales-tiled", Q, "np.repeat(block_scale, 4, axis=1)", "np.tile(block_scale, (1, 4))"),
    ("jit-digest-names-only", J, 'path.name.encode() + b"\\0" + path.read_bytes() + b"\\0"', 'path.name.encode() + b"\\0"'),
    ("jit-digest-contents-only", J, 'path.name.encode() + b"\\0" + path.read_bytes() + b"\\0"', 'path.read_bytes() + b"\\0"'),
    ("jit-user-setting-overridden", J, '    if "NUMBA_CACHE_DIR" in environ:\n        return None\n', ""),
    ("jit-xdg-ignored", J, 'base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")', 'base = str(Path.home() / ".cache")'),
    ("jit-locks-swapped", J, 'fcntl.LOCK_EX if name == "save" else fcntl.LOCK_SH', 'fcntl.LOCK_SH if name == "save" else fcntl.LOCK_EX'),
    ("jit-flock-always-shared", J, "        fcntl.flock(lock, mode)\n", "        fcntl.flock(lock, fcntl.LOCK_SH)\n"),
    ("jit-load-unlocked", J, 'for name in ("save", "load"):', 'for name in ("save",):'),
    ("probe-sum-drops-tail", P, "step = (a.size + n_chunks - 1) // n_chunks", "step = a.size // n_chunks"),
    ("probe-forkjoin-one-row", P, "for c in prange(lines.shape[0]):\n            lines[c, 0] += 1.0", "for c in prange(lines.shape[0]):\n            lines[0, 0] += 1.0"),
]

TRITON = [
    ("tri-dense-reads-past-split", T, "nmask = (n < hi) & (n >= first)", "nmask = (n <= hi) & (n >= first)"),
    ("tri-paged-reads-sink-rows", T, "nmask = (n < length) & (n >= first)", "nmask = n < length"),
    ("tri-q4-high-nibble-shift", T, "shift_of = ((cols % 32) // 16 * 4).to(tl.uint8)", "shift_of = ((cols % 16) // 8 * 4).to(tl.uint8)"),
    ("tri-packed-offset-binary", T, "return ((field ^ half) - half).to(tl.float32)", "return (field - half).to(tl.float32)"),
    ("tri-alpha-nan-sink-tile", T, "alpha = tl.exp2(m_i - m_ref)", "alpha = tl.exp2(m_i - m_new)"),
    ("tri-l-not-rescaled", T, "l_i = l_i * alpha + tl.sum(p, 1)", "l_i = l_i + tl.sum(p, 1)"),
    ("tri-v-scale-k-qmax", T, "p = p * (vs * (1.0 / V_QMAX))[None, :]", "p = p * (vs * (1.0 / K_QMAX))[None, :]"),
    ("tri-acc-not-rescaled", T, "acc = acc * alpha[:, None] + tl.dot(p, vt", "acc = acc + tl.dot(p, vt"),
    ("gpu-merge-unweighted-l", G, "/ (lsum * w).sum(1)[..., None]", "/ lsum.sum(1)[..., None]"),
    ("gpu-sink-rows-read-twice", G, "first = first if sink is None else sink[0].shape[1]", "first = first"),
    ("gpu-sink-m-natural-base", G, "m2[:, 0, :group] = (m * LOG2E).reshape(n_kv, group).float()", "m2[:, 0, :group] = m.reshape(n_kv, group).float()"),
    ("gpu-sink-blind-inverted", G, "blind = ~(torch.as_tensor(blocks, device=q.device) == 0).any(dim=1)", "blind = (torch.as_tensor(blocks, device=q.device) == 0).any(dim=1)"),
    ("gpu-block-at-length-accepted", G, "int(selected.max()) * BLOCK >= length", "int(selected.max()) * BLOCK > length"),
    ("gpu-split-len-floor", G, "split_len = -(-(n_sel if blocks is not None or table is not None else length) // n_splits)", "split_len = (n_sel if blocks is not None or table is not None else length) // n_splits"),
    ("gpu-qmax-float-kinds", G, "return float(kind.qmax) if kind.row_scaled else 1.0", "return float(kind.qmax) if kind.int8 else 1.0"),
    ("gpu-table-bound-off", G, "(int(used.max()) + 1) * BLOCK > cap", "int(used.max()) * BLOCK > cap"),
]


write_list(HERE / "ref34.json", REF)
write_list(HERE / "triton34.json", TRITON)

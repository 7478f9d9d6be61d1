import time, torch, sys
torch.set_num_threads(2)
sizes = [16, 64, 128, 192, 256, 512]
bufs = {s: torch.ones(s * 2**20 // 4) for s in sizes}
for rep in range(int(sys.argv[1])):
    line = []
    for s, b in bufs.items():
        b.sum()
        t0 = time.perf_counter(); n = 0
        while time.perf_counter() - t0 < 0.15:
            b.sum(); n += 1
        line.append(f"{s}MB:{n * b.numel() * 4 / (time.perf_counter() - t0) / 1e9:5.1f}")
    print(" ".join(line), flush=True)

import time, torch, sys
from tokenmill.params import SamplingParams
from tokenmill.runner.sampler import Sampler, SamplingRow
dev = sys.argv[1]
if dev == "cpu": torch.set_num_threads(1)
V = 49152
def bench(name, params_list, B=256, iters=20):
    rows = [SamplingRow(f"r{i}", params_list[i % len(params_list)], list(range(200)), list(range(50)), frozenset({2}), 0) for i in range(B)]
    x = torch.randn(B, V, device=dev)
    s = Sampler(seed=0)
    for _ in range(3): s(x, rows)
    if dev == "cuda": torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters): s(x, rows)
    if dev == "cuda": torch.cuda.synchronize()
    print(f"{dev} {name:28s} B={B}: {(time.perf_counter()-t)/iters*1e3:.2f} ms/step")
bench("greedy", [SamplingParams(temperature=0)])
bench("temp", [SamplingParams(temperature=0.8)])
bench("temp+seed", [SamplingParams(temperature=0.8, seed=1)])
bench("top_k", [SamplingParams(top_k=50)])
bench("top_p", [SamplingParams(top_p=0.9)])
bench("all + penalties + logprobs", [SamplingParams(top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.5, logprobs=5)])

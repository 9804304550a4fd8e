"""The products vLLM's CPU MLA runs through torch, swept for what the vllm-cpu profiles rely on
(numerics/vllm/mla.py), under the ISA limit this process was started with (ONEDNN_MAX_CPU_ISA /
MKL_ENABLE_INSTRUCTIONS): in bf16, a row of the absorbed decode's ``bmm`` (q_nope x W_UK_T, latent x
W_UV, as vLLM's strided views) does not depend on how many decode tokens share the call nor on how
many heads it holds, and a row / column of kv_b_proj's ``F.linear`` not on the other rows / columns.
One thread, as the engine's workers and torchrun's ranks run. Writes {"cases", "bad"} to argv[1]."""
import json
import sys

import torch

ROWS = list(range(1, 65)) + [96, 128, 200]
FULL = 256


def bits(t):
    return t.contiguous().view(torch.int16)


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def sweep(heads, nope, v_dim, latent=512):
    cases, bad = 0, []
    kv_up = randn(heads * (nope + v_dim), latent, seed=1) * latent ** -0.5
    w = kv_up.T.view(latent, heads, nope + v_dim)  # vLLM's views of the kv_b_proj weight
    w_uk, w_uv = w.split([nope, v_dim], dim=-1)
    w_uk_t, w_uv = w_uk.permute(1, 2, 0), w_uv.transpose(0, 1)
    q = randn(FULL, heads, nope + 64, seed=2)
    c = randn(FULL, heads, latent, seed=3)

    def absorb(rows, h):
        out = rows.new_empty((rows.shape[0], h, latent))
        torch.bmm(rows[:, :h, :nope].transpose(0, 1), w_uk_t[:h], out=out.transpose(0, 1))
        return out

    def up(rows, h):
        out = rows.new_empty((rows.shape[0], h, v_dim))
        torch.bmm(rows[:, :h].transpose(0, 1), w_uv[:h], out=out.transpose(0, 1))
        return out

    full_absorb, full_up = absorb(q, heads), up(c, heads)
    for m in ROWS:
        for name, got, want in (("absorb", absorb(q[:m].contiguous(), heads), full_absorb[:m]),
                                ("v_up", up(c[:m].contiguous(), heads), full_up[:m])):
            cases += 1
            if not torch.equal(bits(got), bits(want)):
                bad.append(f"{name} heads={heads} rows={m}")
    for h in sorted({1, 2, heads // 2, heads} - {0}):
        for name, got, want in (("absorb", absorb(q, h), full_absorb[:, :h]), ("v_up", up(c, h), full_up[:, :h])):
            cases += 1
            if not torch.equal(bits(got), bits(want)):
                bad.append(f"{name} heads {h} of {heads}")
    x = randn(FULL, latent, seed=4)
    full = torch.nn.functional.linear(x, kv_up)
    for m in ROWS:
        cases += 1
        if not torch.equal(bits(torch.nn.functional.linear(x[:m], kv_up)), bits(full[:m])):
            bad.append(f"kv_b_proj heads={heads} rows={m}")
    per_head = nope + v_dim
    for parts in (2, 4):
        for r in range(parts):
            rows = slice(r * heads // parts * per_head, (r + 1) * heads // parts * per_head)
            cases += 1
            if not torch.equal(bits(torch.nn.functional.linear(x, kv_up[rows])), bits(full[:, rows])):
                bad.append(f"kv_b_proj heads={heads} columns of rank {r}/{parts}")
    return cases, bad


def main():
    torch.set_num_threads(1)
    cases, bad = 0, []
    for heads, nope, v_dim in ((4, 32, 32), (16, 128, 128)):  # the tiny test model's; DeepSeek-V3's per 8 ranks
        c, b = sweep(heads, nope, v_dim)
        cases, bad = cases + c, bad + b
    with open(sys.argv[1], "w") as f:
        json.dump({"cases": cases, "bad": bad}, f)


if __name__ == "__main__":
    main()

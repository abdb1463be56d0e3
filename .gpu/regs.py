import sys, torch
sys.path.insert(0, '.')
from bench.launch_sweep import REAL_HEADS, AttentionShape, attention_call
from bench.kernels import Env
from executor.kernels.attention import PagedAttention
from executor.kernels.codec import build_codec
from executor.kernels.decode_attention import DecodeAttention
env = Env(False)
codec = build_codec("bfloat16")
general = PagedAttention(codec, 128, 4)
call, _ = attention_call(env, REAL_HEADS, AttentionShape(2, 64, None), general)
for config in ({"warps": 4, "slots": 2, "blocks_per_sm": None}, {"warps": 4, "slots": 2, "blocks_per_sm": 4},
               {"warps": 4, "slots": 2, "blocks_per_sm": 3}, {"warps": 2, "slots": 3, "blocks_per_sm": None}):
    a = DecodeAttention(codec, 128, 4, general, **config)
    call(a, 0)
    torch.cuda.synchronize()
    d = a.kernels[0].dispatcher
    print(config, "regs", d.get_regs_per_thread(), "local", d.get_local_mem_per_thread(), flush=True)

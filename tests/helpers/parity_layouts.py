"""The layouts both parity suites shard their small model with: 8 heads over 2 KV heads, 96 FFN and 128 vocab units,
split evenly and unevenly (non-contiguous ranges whose ranks share KV heads and read them irregularly)."""

from ntp_ds.layout.shard_layout import ModelUnits, ParamSpec, ShardLayout

UNITS = ModelUnits(heads=8, kv_heads=2, ffn=96, vocab=128)
LOGITS = ParamSpec("vocab", 2, 1)
UNEVEN_2 = ShardLayout(UNITS, heads=(((0, 1), (5, 8)), ((1, 5),)), ffn=(((0, 10), (50, 96)), ((10, 50),)),
                       vocab=(((0, 3), (60, 128)), ((3, 60),)))
UNEVEN_3 = ShardLayout(UNITS, heads=(((0, 1), (7, 8)), ((1, 4),), ((4, 7),)),
                       ffn=(((0, 5), (90, 96)), ((5, 30), (60, 90)), ((30, 60),)),
                       vocab=(((100, 128),), ((0, 10), (50, 100)), ((10, 50),)))
assert UNEVEN_2.shares_kv() and UNEVEN_3.shares_kv() and ShardLayout.balanced(UNITS, 3).shares_kv()

"""Property test: random add / abort / step sequences keep every invariant and leak nothing."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_sim import make_request, make_scheduler, run_step

actions = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.lists(st.integers(0, 3), min_size=1, max_size=40),  # small alphabet: prefix hits
            st.integers(1, 12),
            st.integers(1, 3),
        ),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("step"), st.integers(1, 3)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    actions=actions,
    num_blocks=st.integers(12, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(8, 64),
    max_num_seqs=st.integers(1, 6),
    prefix_caching=st.booleans(),
)
def test_random_workloads_keep_invariants(
    actions, num_blocks, block_size, budget, max_num_seqs, prefix_caching
):
    s = make_scheduler(num_blocks, block_size, max_num_seqs, budget, prefix_caching)
    # Every request must fit the pool alone (the engine caps max_model_len to guarantee it).
    capacity = num_blocks * block_size
    next_id = 0
    for action in actions:
        if action[0] == "add":
            _, prompt, max_tokens, n = action
            prompt = prompt[: capacity - 1]
            max_tokens = min(max_tokens, capacity - len(prompt))
            s.add_request(make_request(f"r{next_id}", prompt, max_tokens, min(n, max_num_seqs)))
            next_id += 1
        elif action[0] == "abort":
            s.abort([f"r{action[1]}", *(f"r{action[1]}#{i}" for i in (1, 2))])
        else:
            for _ in range(action[1]):
                check_step(s, budget, max_num_seqs)
        s.check_kv_integrity()
    for _ in range(10_000):
        if not s.num_unfinished:
            break
        check_step(s, budget, max_num_seqs)
        s.check_kv_integrity()
    assert s.num_unfinished == 0, "requests left unfinished: the scheduler stalled"
    assert s.kv_stats().num_free_blocks == num_blocks


def check_step(s, budget, max_num_seqs):
    output, _ = run_step(s)
    assert output.total_num_tokens <= budget
    assert len(output.scheduled) <= max_num_seqs
    for item in output.scheduled:
        assert item.num_tokens >= 1
        assert item.num_blocks * s.kv.block_size >= item.seq_len

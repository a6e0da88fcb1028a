"""An episode's recorded calls as training rows (flowrl/serve/record.py): one row while each
prompt extends the last context, a new row where the history was rewritten."""

from flowrl.serve.record import Call, Recorder, broadcast, segments


def call(prompt, completion, version=0):
    return Call(prompt, completion, [-0.1 * (k + 1) for k in range(len(completion))], version)


def test_calls_that_extend_the_context_make_one_row():
    # prompt [1 2 3], the model says [10 11 EOS=2]; the agent adds a tool turn [7 8] and asks again
    first = call([1, 2, 3], [10, 11, 2])
    second = call([1, 2, 3, 10, 11, 2, 7, 8], [12, 2], version=1)
    (row,) = segments([first, second])
    assert row.prompt_ids == [1, 2, 3]
    assert row.ids == [10, 11, 2, 7, 8, 12, 2]
    assert row.mask == [1, 1, 1, 0, 0, 1, 1]  # the tool turn is attended to, not trained
    assert row.logprobs == [-0.1, -0.2, -0.30000000000000004, 0.0, 0.0, -0.1, -0.2]
    assert row.versions == [0, 1] and row.calls == 2


def test_a_rewritten_history_starts_a_new_row():
    first = call([1, 2, 3], [10, 11, 2])
    # the template re-rendered the assistant turn as [10, 99, 2]: the model never saw that
    second = call([1, 2, 3, 10, 99, 2, 7], [12, 2])
    third = call([1, 2, 3, 10, 99, 2, 7, 12, 2, 5], [13])  # extends the second
    rows = segments([first, second, third])
    assert [r.prompt_ids for r in rows] == [[1, 2, 3], [1, 2, 3, 10, 99, 2, 7]]
    assert rows[0].ids == [10, 11, 2] and rows[0].mask == [1, 1, 1]
    assert rows[1].ids == [12, 2, 5, 13] and rows[1].mask == [1, 1, 0, 1]
    # every sampled token is trained exactly once
    sampled = sum(len(c.completion_ids) for c in (first, second, third))
    assert sum(sum(r.mask) for r in rows) == sampled


def test_a_prompt_that_only_shares_a_prefix_is_a_break():
    rows = segments([call([1, 2, 3], [4, 2]), call([1, 2], [5])])
    assert len(rows) == 2 and rows[1].prompt_ids == [1, 2]


def test_episode_values_broadcast_to_their_rows():
    # two episodes of a group: scores 1 and 0; the first split in 3 rows
    assert broadcast([0.5, -0.5], [3, 1]) == [0.5, 0.5, 0.5, -0.5]


def test_recorder_keeps_episodes_apart():
    recorder = Recorder()
    recorder.add("a", [1], [2], [-0.5], 0, "stop")
    recorder.add("b", [3], [4], [-0.25], 1, "length")
    recorder.add("a", [1, 2, 9], [5], [-0.1], 0, "stop")
    a = recorder.take("a")
    assert [c.prompt_ids for c in a] == [(1,), (1, 2, 9)]
    assert recorder.take("a") == [] and recorder.take("b")[0].version == 1

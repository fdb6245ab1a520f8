"""The cluster's routing, without Ray: what a request is routed by (`keys`) and which replica it goes to
(`policy`)."""

from __future__ import annotations

import json
import random

from hypothesis import given
from hypothesis import strategies as st

from onnxgen.serve.cluster.keys import (
    RouteKey,
    prefix_digests,
    prompt_text,
    route_key,
    session_digest,
    tenant,
)
from onnxgen.serve.cluster.policy import Loads, Policy, ReplicaState

B = 16  # a small block, so short texts span several


def _body(messages, **extra) -> bytes:
    return json.dumps({"model": "m", "messages": messages, **extra}).encode()


@given(st.text(max_size=200), st.text(max_size=200), st.sampled_from(["", "a", "b|x"]))
def test_digest_i_is_shared_exactly_when_the_first_i_plus_1_blocks_are(a, b, salt):
    da, db = prefix_digests(salt, a, B), prefix_digests(salt, b, B)
    assert len(da) == len(a) // B
    for i in range(min(len(da), len(db))):
        assert (da[i] == db[i]) == (a[: (i + 1) * B] == b[: (i + 1) * B])


@given(st.text(min_size=B, max_size=100))
def test_another_salt_shares_nothing(text):
    assert not set(prefix_digests("k1|", text, B)) & set(prefix_digests("k2|", text, B))


@given(st.lists(st.text(max_size=80), min_size=1, max_size=6), st.text(max_size=80))
def test_a_conversation_resent_with_one_more_turn_keeps_all_but_its_last_block(turns, reply):
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    old = route_key("POST", "/v1/chat/completions", {}, _body(msgs), block_chars=B).prefixes
    longer = [*msgs, {"role": "assistant", "content": reply}, {"role": "user", "content": "next"}]
    new = route_key("POST", "/v1/chat/completions", {}, _body(longer), block_chars=B).prefixes
    shared = next(
        (i for i, (x, y) in enumerate(zip(old, new, strict=False)) if x != y), min(len(old), len(new))
    )
    assert shared >= len(old) - 1


@given(
    st.binary(max_size=300),
    st.dictionaries(
        st.sampled_from(["x-session-id", "authorization", "x-api-key", "x-cache-salt"]), st.text(max_size=40)
    ),
)
def test_route_key_never_raises(body, headers):
    key = route_key("POST", "/v1/chat/completions", headers, body)
    assert isinstance(key, RouteKey)


def test_what_a_request_is_routed_by():
    msgs = [{"role": "system", "content": "s" * 600}, {"role": "user", "content": "hi"}]
    key = route_key("POST", "/v1/chat/completions", {"x-session-id": " abc "}, _body(msgs))
    assert (
        key.session == session_digest("abc")
        and len(key.prefixes) == len(prompt_text({"messages": msgs})) // 256
    )
    # the session of /v1/sessions/{id}/save and DELETE /v1/sessions/{id} is in the path
    assert route_key("POST", "/v1/sessions/abc/save", {}, b"").session == session_digest("abc")
    # tenancy: another key, another salt, or another cache_salt shares no prefix digest
    plain = route_key("POST", "/v1/chat/completions", {"authorization": "Bearer k1"}, _body(msgs)).prefixes
    for headers, extra in (
        ({"authorization": "Bearer k2"}, {}),
        ({"x-api-key": "k2"}, {}),
        ({"authorization": "Bearer k1", "x-cache-salt": "t"}, {}),
        ({"authorization": "Bearer k1"}, {"cache_salt": "t"}),
    ):
        other = route_key("POST", "/v1/chat/completions", headers, _body(msgs, **extra)).prefixes
        assert other and not set(other) & set(plain)
    assert route_key("POST", "/v1/chat/completions", {"x-api-key": "k1"}, _body(msgs)).prefixes == plain
    # keyless callers isolated by the server share nothing, so nothing is matched for them
    assert tenant({}, None, isolate_keyless=True) is None
    assert route_key("POST", "/v1/chat/completions", {}, _body(msgs), isolate_keyless=True).prefixes == ()
    # completions, responses and messages name their prompt in their own fields
    for doc in (
        {"prompt": "p" * 600},
        {"input": "i" * 600},
        {"system": "x", "messages": [{"role": "user", "content": "m" * 600}]},
    ):
        assert len(route_key("POST", "/v1/x", {}, json.dumps(doc).encode()).prefixes) >= 2
    assert route_key("POST", "/v1/x", {}, b'{"model": "m"}') == RouteKey()


def _replicas(*loads, sessions=None, prefixes=None):
    sessions, prefixes = sessions or {}, prefixes or {}
    return [
        ReplicaState(
            f"r{i}", load, frozenset(sessions.get(f"r{i}", ())), frozenset(prefixes.get(f"r{i}", ()))
        )
        for i, load in enumerate(loads)
    ]


def test_a_session_stays_on_its_replica_until_the_imbalance_bound():
    p = Policy(imbalance=2, rng=random.Random(0))
    key = RouteKey(session="s")
    first = p.choose(key, _replicas(0, 0, 0)).ranks[0][0]
    for load in range(3):  # the holder may carry up to `imbalance` more requests than the least loaded
        loads = [load if f"r{i}" == first else 0 for i in range(3)]
        c = p.choose(key, _replicas(*loads))
        assert c.ranks == ((first,),) and c.reason == "session"
    loads = [3 if f"r{i}" == first else 0 for i in range(3)]
    c = p.choose(key, _replicas(*loads))
    assert c.reason == "yield" and c.ranks[0][0] != first
    assert p.bound("s") == c.ranks[0][0]  # rebound where it went


def test_new_sessions_spread_over_equally_loaded_replicas():
    p = Policy(rng=random.Random(1))
    placed = [p.choose(RouteKey(session=f"s{i}"), _replicas(0, 0, 0)).ranks[0][0] for i in range(9)]
    assert sorted(placed.count(f"r{i}") for i in range(3)) == [3, 3, 3]


def test_a_restarted_router_finds_sessions_in_the_replicas_stats():
    p = Policy()
    replicas = _replicas(3, 0, sessions={"r0": {"s"}})
    assert p.choose(RouteKey(session="s"), replicas).ranks == (("r0",),)
    assert p.bound("s") == "r0"


def test_a_dead_replicas_sessions_are_rebound():
    p = Policy()
    p.choose(RouteKey(session="s"), _replicas(0, 9))  # bound to r0
    p.forget_replica("r0")
    assert p.bound("s") is None
    assert p.choose(RouteKey(session="s"), _replicas(0, 9)[1:]).ranks == (("r1",),)


def test_a_stateless_request_goes_to_the_longest_cached_prefix():
    key = RouteKey(prefixes=("a", "b", "c", "d"))
    replicas = _replicas(1, 0, 2, prefixes={"r0": {"a", "b", "c"}, "r1": {"a"}, "r2": {"b", "c", "d"}})
    c = Policy().choose(key, replicas)
    assert c.reason == "prefix" and c.ranks == (("r0",), ("r1", "r2"))
    # equal matches: the less loaded
    assert Policy().choose(key, _replicas(3, 1, prefixes={"r0": {"a"}, "r1": {"a"}})).ranks[0] == ("r1",)
    # past the bound, load decides
    c = Policy(imbalance=1).choose(key, _replicas(3, 0, prefixes={"r0": {"a", "b"}}))
    assert c.reason == "yield" and c.ranks[0][0] == "r1"


def test_routed_prefixes_are_learned_before_the_replica_publishes_them():
    p = Policy(rng=random.Random(0))
    key = RouteKey(prefixes=("a", "b"))
    first = p.choose(key, _replicas(0, 0, 0)).ranks[0][0]
    longer = RouteKey(prefixes=("a", "b", "c"))
    assert p.choose(longer, _replicas(0, 0, 0)).ranks[0] == (first,)


def test_baselines():
    rr = Policy(mode="round_robin")
    seen = [rr.choose(RouteKey(session="s"), _replicas(0, 0, 0)).ranks[0][0] for _ in range(6)]
    assert seen == ["r1", "r2", "r0", "r1", "r2", "r0"]
    load = Policy(mode="load", rng=random.Random(0))
    c = load.choose(RouteKey(session="s", prefixes=("a",)), _replicas(4, 1, prefixes={"r0": {"a"}}))
    assert c.reason == "load" and c.ranks == (("r1",), ("r0",))


@given(
    st.lists(st.integers(0, 10), min_size=0, max_size=5),
    st.one_of(
        st.none(),
        st.builds(
            RouteKey,
            st.one_of(st.none(), st.sampled_from("st")),
            st.lists(st.sampled_from("abc"), max_size=3).map(tuple),
        ),
    ),
    st.sampled_from(["affinity", "round_robin", "load"]),
    st.integers(0, 3),
)
def test_every_choice_names_candidates_once(loads, key, mode, imbalance):
    p = Policy(mode=mode, imbalance=imbalance, rng=random.Random(0))
    replicas = _replicas(*loads, sessions={"r0": {"s"}}, prefixes={"r1": {"a", "b"}})
    for _ in range(3):
        c = p.choose(key, replicas)
        ids = [i for rank in c.ranks for i in rank]
        assert len(ids) == len(set(ids)) and set(ids) <= {r.id for r in replicas}
        assert bool(ids) == bool(replicas)


def test_a_momentary_difference_in_load_does_not_outweigh_the_sessions_held():
    p = Policy(imbalance=2, rng=random.Random(0))
    assert p.choose(RouteKey(session="a"), _replicas(0, 2, sessions={"r0": {"x"}})).ranks == (("r1",),)
    assert p.choose(RouteKey(session="b"), _replicas(0, 3, sessions={"r0": {"x"}})).ranks == (("r0",),)


def test_a_replica_chosen_counts_as_loaded_until_sent_or_expired():
    now = [0.0]
    loads = Loads(hold_s=1.0, clock=lambda: now[0])
    loads.chosen("a")
    loads.chosen("a")
    assert loads["a"] == 2 and loads["b"] == 0  # routed at once, before either was sent
    loads.sent("a")
    assert loads["a"] == 2  # one sent, one still chosen
    now[0] = 1.5
    assert loads["a"] == 1  # the choice the router did not follow expired
    loads.done("a")
    loads.done("a")
    assert loads["a"] == 0
    loads.chosen("b")
    loads.forget("b")
    assert loads["b"] == 0


def test_requests_routed_at_once_spread_by_their_choices():
    p, loads = Policy(rng=random.Random(1)), Loads()
    for i in range(8):
        states = [ReplicaState(r, loads[r]) for r in ("r0", "r1")]
        loads.chosen(p.choose(RouteKey(prefixes=(f"x{i}",)), states).ranks[0][0])
    assert loads["r0"] == loads["r1"] == 4

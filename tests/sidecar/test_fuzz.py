"""Property-based tests (hypothesis) of what crosses the sidecar's two boundaries: any body the control
API can be sent gets a 2xx or a 4xx, never a 5xx, and a 4xx changes nothing (state and policy.json);
any bytes handed to the draft protocol's decoders give a valid message or a ProtocolError, never
anything else; and every message the encoders write decodes back to itself."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve_engine.api import SidecarConfig, SidecarState
from specserve_engine.control_api import build_app
from specserve_engine.draft_protocol import (
    MAX_ROWS,
    DraftRequest,
    DraftResponse,
    ProtocolError,
    RowAnswer,
    RowOp,
    RowStatus,
    RowUpdate,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from specserve_engine.policy_file import policy_path
from specserve_engine.sidecar_service import SidecarService

TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_API = settings(FUZZ, max_examples=1000)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
# Bodies shaped like a policy, so most examples get past the schema into the service's own checks.
policy_like = st.fixed_dictionaries(
    {},
    optional={
        "policyVersion": st.integers(min_value=-2, max_value=6) | json_values,
        "drafter": st.sampled_from(["ngram", "suffix", "self", "eagle9", ""]) | json_values,
        "mode": st.sampled_from(["on", "off", "sometimes"]) | json_values,
        "kByBucket": st.dictionaries(
            st.sampled_from(["1", "2", "4", "8", "+Inf", "3", "inf"]) | st.text(max_size=4),
            st.integers(min_value=-1, max_value=6) | json_values,
            max_size=6,
        )
        | json_values,
        "extra": json_values,
    },
)
# Well-formed policies, and the same with numbers of the wrong JSON type ("7", 7.0, true).
versions = st.integers(min_value=2, max_value=10**9)
buckets = st.sampled_from(["1", "2", "4", "8", "+Inf"])
loose_ks = st.integers(0, 4).map(float) | st.booleans() | st.integers(0, 4).map(str)
policies = st.fixed_dictionaries(
    {
        "policyVersion": versions | versions.map(str) | versions.map(float),
        "drafter": st.sampled_from(["ngram", "suffix"]),
        "mode": st.sampled_from(["on", "off"]),
        "kByBucket": st.dictionaries(buckets, st.integers(0, 4) | loose_ks, max_size=5),
    }
)
bodies = (
    policies.map(lambda d: json.dumps(d).encode())
    | policy_like.map(lambda d: json.dumps(d).encode())
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=200)
)


def test_any_body_gets_a_2xx_or_a_4xx_and_a_4xx_changes_nothing(config: SidecarConfig) -> None:
    loop = asyncio.new_event_loop()
    try:
        service = SidecarService(config)
        loop.run_until_complete(service.start())
        client = TestClient(TestServer(build_app(service, TOKEN)), loop=loop)
        loop.run_until_complete(client.start_server())
        file = policy_path(config.runtime_dir)
        statuses: set[int] = set()

        async def put(raw: bytes) -> tuple[int, Any]:
            resp = await client.put("/v1/policy", data=raw, headers=AUTH)
            return resp.status, await resp.json(content_type=None)

        @FUZZ_API
        @given(raw=bodies)
        def check(raw: bytes) -> None:
            before = (service.state(), file.read_text())
            status, body = loop.run_until_complete(put(raw))
            statuses.add(status)
            assert status < 500, (raw, body)
            if status >= 400:
                assert set(body) <= {"error", "field"} and body["error"]
                assert (service.state(), file.read_text()) == before
            else:  # accepted: only a body whose every number is a JSON integer (the wire is strict)
                SidecarState.model_validate(body)
                data = json.loads(raw)
                assert type(data["policyVersion"]) is int
                assert all(type(k) is int for k in data.get("kByBucket", {}).values())

        check()
        assert {400, 422, 200} <= statuses  # the strategies reach the parser, the schema and the service
        loop.run_until_complete(client.close())
    finally:
        loop.close()


def _after_magic(message: DraftRequest | DraftResponse) -> Any:
    """Random bytes behind a valid magic, so the decoder gets past its first check."""
    frame = encode_request(message) if isinstance(message, DraftRequest) else encode_response(message)
    return st.binary(max_size=300).map(lambda raw: frame[4:8] + raw)


arbitrary = (
    st.binary(max_size=300) | _after_magic(DraftRequest(0, 0, [])) | _after_magic(DraftResponse(0, []))
)


@FUZZ
@given(raw=arbitrary)
def test_decoding_arbitrary_bytes_gives_a_message_or_a_protocol_error(raw: bytes) -> None:
    try:
        req = decode_request(raw)
    except ProtocolError:
        pass
    else:
        assert len(req.rows) <= MAX_ROWS
        assert encode_request(req)[4:] == raw  # a request that decodes is exactly what it encodes to
    try:
        resp = decode_response(raw)
    except ProtocolError:
        pass
    else:
        assert all(isinstance(a.status, RowStatus) and 0 <= len(a.drafts) <= 255 for a in resp.answers)


u32 = st.integers(min_value=0, max_value=2**32 - 1)
i32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
rows = st.builds(
    RowUpdate,
    row=u32,
    op=st.sampled_from(RowOp),
    max_k=st.integers(min_value=0, max_value=255),
    start=u32,
    tokens=st.lists(i32, max_size=40).map(lambda t: np.array(t, dtype=np.int32)),
)
requests = st.builds(DraftRequest, call_id=u32, batch_size=u32, rows=st.lists(rows, max_size=8))
responses = st.builds(
    DraftResponse,
    call_id=u32,
    answers=st.lists(
        st.builds(RowAnswer, status=st.sampled_from(RowStatus), drafts=st.lists(i32, max_size=16)), max_size=8
    ),
)


@FUZZ
@given(req=requests)
def test_requests_round_trip(req: DraftRequest) -> None:
    frame = encode_request(req)
    assert int.from_bytes(frame[:4], "little") == len(frame) - 4
    back = decode_request(frame[4:])
    assert (back.call_id, back.batch_size) == (req.call_id, req.batch_size)
    assert [(r.row, r.op, r.max_k, r.start, r.tokens.tolist()) for r in back.rows] == [
        (r.row, r.op, r.max_k, r.start, r.tokens.tolist()) for r in req.rows
    ]


@FUZZ
@given(resp=responses)
def test_responses_round_trip(resp: DraftResponse) -> None:
    frame = encode_response(resp)
    assert decode_response(frame[4:]) == resp

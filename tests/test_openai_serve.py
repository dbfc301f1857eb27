"""`atencion serve`'s OpenAI protocol, spoken by the client people use: the official ``openai`` SDK
(sync, async and streaming) against a server on a free loopback port, serving Hugging Face
directories with random weights (a Llama with a chat template, a BERT). Checked against
transformers on the same directories (the chat template's rendering, the prompt's tokens, the
embeddings, the greedy text), and against the same request run alone (continuous batching);
every bad request is one OpenAI-shaped 4xx naming the parameter, never a 500."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

import uvicorn  # noqa: E402

from atencion.serve.app import ServeSettings, create_app  # noqa: E402
from atencion.serve.run import listen, load_models, uvicorn_config  # noqa: E402
from test_hf_dirs import CHAT, save_llama_dir, wordpiece  # noqa: E402

KEY = "test-key"


@contextmanager
def serving(specs: list[str], **settings):
    """A server for the model directories ``specs`` ([NAME=]DIR) on a free loopback port, in a thread
    of this process, configured as `atencion serve` configures it; yields (base URL, its context)."""
    limits = ServeSettings(**settings)
    app = create_app(load_models(specs), limits)
    sockets = listen("127.0.0.1", 0)
    port = sockets[0].getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, limits))
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", app.state.context
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("openai")
    llama = save_llama_dir("llama", root / "llama")
    (llama / "chat_template.jinja").write_text(CHAT, encoding="utf-8")
    plain = save_llama_dir("llama", root / "plain")  # no chat template
    torch.manual_seed(0)
    bert = root / "bert"
    wp = wordpiece()
    transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=len(wp), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=0, initializer_range=0.3)).save_pretrained(bert)
    wp.save_pretrained(bert)
    return {"llama": llama, "plain": plain, "bert": bert}


@pytest.fixture(scope="module")
def server(dirs):
    with serving([f"llama={dirs['llama']}", f"plain={dirs['plain']}", f"bert={dirs['bert']}"],
                 api_key=KEY) as (url, ctx):
        yield url, ctx


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def theirs(dirs):
    """transformers' model and tokenizer of the Llama directory."""
    return (transformers.AutoModelForCausalLM.from_pretrained(dirs["llama"]).eval(),
            transformers.AutoTokenizer.from_pretrained(dirs["llama"]))


def greedy(model, ids: list[int], new: int, stop: int | None) -> list[int]:
    """transformers' greedy continuation of ``ids``: ``new`` tokens, or fewer up to ``stop``."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=stop,
                             pad_token_id=0)[0, len(ids):].tolist()
    return out


def test_models_lists_every_served_model(client):
    assert sorted(m.id for m in client.models.list()) == ["bert", "llama", "plain"]
    assert client.models.retrieve("llama").id == "llama"


def test_a_completion_is_transformers_greedy_text_of_the_prompt_tokenized_as_transformers_does(client, theirs):
    model, tokenizer = theirs
    prompt = "the cat sat on"
    answer = client.completions.create(model="llama", prompt=prompt, max_tokens=12, temperature=0)
    ids = tokenizer(prompt)["input_ids"]
    new = greedy(model, ids, 12, tokenizer.eos_token_id)
    assert answer.choices[0].text == tokenizer.decode(new, skip_special_tokens=True)
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.usage.completion_tokens == len(new)
    assert answer.usage.total_tokens == len(ids) + len(new)
    assert answer.choices[0].finish_reason == ("stop" if new[-1] == tokenizer.eos_token_id else "length")


def test_chat_renders_the_messages_as_transformers_chat_template_does(client, theirs):
    model, tokenizer = theirs
    messages = [{"role": "user", "content": "the dog"}, {"role": "assistant", "content": "ran"},
                {"role": "user", "content": "cat"}]
    answer = client.chat.completions.create(model="llama", messages=messages, max_tokens=6, temperature=0)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = list(ids["input_ids"]) if isinstance(ids, dict) or hasattr(ids, "keys") else list(ids)
    new = greedy(model, ids, 6, tokenizer.eos_token_id)
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == tokenizer.decode(new, skip_special_tokens=True)
    assert answer.usage.prompt_tokens == len(ids)


def test_streamed_deltas_join_into_the_text_not_streamed(client):
    kwargs = dict(model="llama", max_tokens=16, temperature=0)
    whole = client.completions.create(prompt="a dog ran", **kwargs).choices[0].text
    chunks = list(client.completions.create(prompt="a dog ran", stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    messages = [{"role": "user", "content": "the quick brown fox"}]
    whole = client.chat.completions.create(messages=messages, **kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1


def test_the_async_client_gets_what_each_request_gets_alone_under_concurrency(server, client):
    prompts = ["the cat", "she sells sea shells by the", "how much wood", "a", "the quick brown fox jumps over"]
    new = [20 + 4 * i for i in range(len(prompts))]
    alone = [client.completions.create(model="llama", prompt=p, max_tokens=n, temperature=0).choices[0].text
             for p, n in zip(prompts, new)]
    engine = server[1].workers["llama"]
    steps = engine.steps

    async def together():
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0) as aclient:
            async def one(p, n, first):
                if not first:  # the others join once the first runs
                    while not engine.running:
                        await asyncio.sleep(0.001)
                stream = await aclient.completions.create(model="llama", prompt=p, max_tokens=n, temperature=0,
                                                          stream=True)
                return "".join([c.choices[0].text async for c in stream])
            return await asyncio.gather(*(one(p, n, i == 0) for i, (p, n) in enumerate(zip(prompts, new))))

    assert asyncio.run(together()) == alone
    assert engine.steps > steps  # some steps decoded several requests together


def test_seeded_sampling_repeats_and_n_choices_are_numbered(client):
    kwargs = dict(model="llama", prompt="the cat", max_tokens=10, temperature=1.0, seed=7)
    first, again = (client.completions.create(**kwargs) for _ in range(2))
    assert first.choices[0].text == again.choices[0].text
    several = client.completions.create(n=3, **{**kwargs, "prompt": ["the cat", "a dog"]})
    assert [c.index for c in several.choices] == list(range(6))
    assert several.choices[0].text == first.choices[0].text  # choice 0 of prompt 0 draws from the same seed
    assert len({c.text for c in several.choices[:3]}) > 1     # the choices of one prompt draw apart
    ids = client.completions.create(n=2, **{**kwargs, "prompt": [[1, 5, 6], [1, 7]]})
    assert ids.usage.prompt_tokens == 5  # each prompt once, whatever n


def test_a_stop_string_ends_the_text_before_it(client):
    whole = client.completions.create(model="llama", prompt="the cat", max_tokens=20, temperature=0).choices[0]
    text = whole.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("the greedy text has no usable stop string")
    cut = client.completions.create(model="llama", prompt="the cat", max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="llama", prompt="the cat", max_tokens=20, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text[: text.index(stop)]


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client, theirs):
    model, tokenizer = theirs
    prompt = "the quick brown fox"
    ids = tokenizer(prompt)["input_ids"]
    answer = client.completions.create(model="llama", prompt=ids, max_tokens=0, echo=True, logprobs=2,
                                       temperature=0)
    scored = answer.choices[0].logprobs
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert scored.token_logprobs[0] is None and len(scored.token_logprobs) == len(ids)
    for i in range(1, len(ids)):
        assert scored.token_logprobs[i] == pytest.approx(float(expected[i - 1, ids[i]]), abs=1e-4)
        best = sorted(scored.top_logprobs[i].values(), reverse=True)
        assert best[0] == pytest.approx(float(expected[i - 1].max()), abs=1e-4) and len(best) <= 2
    assert "".join(scored.tokens) == answer.choices[0].text == tokenizer.decode(ids, skip_special_tokens=True)
    assert scored.text_offset == sorted(scored.text_offset)
    assert answer.usage.completion_tokens == 0


def test_chat_logprobs_are_the_chosen_tokens_own(client):
    answer = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the most likely one


def test_embeddings_are_the_encoder_s_first_token_output(client, dirs):
    texts = ["the cat sat", "a dog ran in the park"]
    answer = client.embeddings.create(model="bert", input=texts)  # the SDK asks for base64 and decodes it
    floats = client.embeddings.create(model="bert", input=texts, encoding_format="float")
    tokenizer = transformers.AutoTokenizer.from_pretrained(dirs["bert"])
    model = transformers.BertForMaskedLM.from_pretrained(dirs["bert"]).eval()
    for i, text in enumerate(texts):
        with torch.no_grad():
            hidden = model(**tokenizer(text, return_tensors="pt"), output_hidden_states=True).hidden_states[-1]
        expected = hidden[0, 0]
        assert torch.allclose(torch.tensor(answer.data[i].embedding), expected, atol=1e-4)
        assert torch.allclose(torch.tensor(floats.data[i].embedding), expected, atol=1e-4)
    assert answer.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in texts)


def test_a_disconnected_stream_frees_its_place(server):
    url, ctx = server
    engine = ctx.workers["llama"]
    body = {"model": "llama", "prompt": "the cat", "max_tokens": 50, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", url + "/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {KEY}"}) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert len(engine.running) == 1
    deadline = time.time() + 10
    while engine.running and time.time() < deadline:
        time.sleep(0.02)
    assert engine.running == []


def test_curl_sees_chunks_before_the_end(server):
    url, _ = server
    body = json.dumps({"model": "llama", "prompt": "the cat", "max_tokens": 40, "temperature": 0, "stream": True})
    curl = subprocess.Popen(["curl", "-sN", url + "/v1/completions", "-H", f"Authorization: Bearer {KEY}",
                             "-H", "Content-Type: application/json", "-d", body], stdout=subprocess.PIPE, text=True)
    first = curl.stdout.readline()
    assert first.startswith("data: {") and curl.poll() is None  # a chunk came, and the answer goes on
    rest = curl.stdout.read()
    curl.wait(30)
    assert rest.rstrip().endswith("data: [DONE]")


def test_a_model_without_a_chat_template_answers_chat_naming_completions(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}])
    assert "/v1/completions" in caught.value.message and caught.value.body["param"] == "messages"


@pytest.mark.parametrize("kwargs, param, words", [
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"frequency_penalty": 1}, "frequency_penalty", "not supported"),
    ({"logit_bias": {"5": 3}}, "logit_bias", "not supported"),
    ({"temperature": 3}, "temperature", "less than or equal"),
    ({"temperature": -1}, "temperature", "greater than or equal"),
    ({"top_p": 0}, "top_p", "greater than"),
    ({"max_tokens": -1}, "max_tokens", "greater than or equal"),
    ({"max_tokens": 100000}, "max_tokens", "limit"),
    ({"max_tokens": 63}, "max_tokens", "maximum context length is 64"),
    ({"n": 1000}, "n", "limit"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"logprobs": 50}, "logprobs", "less than or equal"),
    ({"prompt": [[1, 2], [5, 99999]]}, "prompt.1", "outside the vocabulary"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": ["x"] * 65}, "prompt", "limit"),
    ({"suffix": "x"}, "suffix", "not supported"),
    ({"best_of": 3}, "best_of", "not supported"),
    ({"wibble": 1}, "wibble", "unknown field"),
    ({"max_tokens": 0}, "max_tokens", "echo"),
    ({"logprobs": 1, "stream": True}, "logprobs", "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"echo": True, "stream": True}, "echo", "stream"),
])
def test_a_bad_completion_is_one_400_naming_the_parameter(client, kwargs, param, words):
    request = {"model": "llama", "prompt": "the cat", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**{k: v for k, v in request.items() if k != "wibble"},
                                  extra_body={"wibble": 1} if "wibble" in kwargs else None)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and error["type"] == "invalid_request_error"
    assert words in error["message"], error["message"]


@pytest.mark.parametrize("kwargs, param", [
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"max_tokens": 5, "max_completion_tokens": 5}, "max_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logprobs": True, "stream": True}, "logprobs"),
])
def test_a_bad_chat_is_one_400_naming_the_parameter(client, kwargs, param):
    request = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**request)
    assert caught.value.body["param"] == param, caught.value.body


@pytest.mark.parametrize("body, status", [
    (b"{not json", 400), (b'{"model": "llama", "prompt": "\\ud800", "max_tokens": 2}', 400),
    (b'\xff\xfe', 400), (b'[1, 2]', 400),
    (b'{"model": "llama", "prompt": "x", "max_tokens": 1' + b"0" * 200 + b"}", 400),
])
def test_malformed_bodies_are_openai_shaped_4xx(server, body, status):
    url, _ = server
    response = httpx.post(url + "/v1/completions", content=body, headers={"Authorization": f"Bearer {KEY}",
                                                                           "Content-Type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_the_sdk_s_errors_carry_the_server_s_message(server, client):
    with pytest.raises(openai.AuthenticationError) as caught:
        openai.OpenAI(base_url=server[0] + "/v1", api_key="wrong", max_retries=0).models.list()
    assert "API key" in caught.value.message
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt="x")
    assert caught.value.body["code"] == "model_not_found" and "'nope'" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="llama", input="x")
    assert "encoder" in caught.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="bert", prompt="x")


def test_a_full_queue_is_429_with_retry_after(dirs):
    with serving([f"llama={dirs['llama']}"], max_queue=1, max_sequences=1) as (url, ctx):
        engine = ctx.workers["llama"]
        busy, release = threading.Event(), threading.Event()

        def hold() -> None:
            busy.set()
            release.wait(30)

        holders = [threading.Thread(target=lambda work=work: asyncio.run(engine.run(work, 30)))
                   for work in (hold, release.is_set)]
        holders[0].start()
        busy.wait(30)           # the engine's thread runs the first ...
        holders[1].start()      # ... and the second waits: the queue (1) is full
        while not len(engine):
            time.sleep(0.01)
        try:
            response = httpx.post(url + "/v1/completions", json={"model": "llama", "prompt": "x", "max_tokens": 2},
                                  headers={"Authorization": "Bearer unused"})
            assert response.status_code == 429 and response.headers["retry-after"] == "1"
            assert response.json()["error"]["type"] == "rate_limit_error"
        finally:
            release.set()
            for holder in holders:
                holder.join(30)
        assert httpx.post(url + "/v1/completions", json={"model": "llama", "prompt": "x",
                                                          "max_tokens": 2}).status_code == 200


def test_stalled_readers_hold_no_place_in_the_batch(server):
    """Clients that ask for a stream and never read it: their sequences run to their end (the engine
    never waits for a reader; what each may hold is its max_tokens), and the others are served."""
    import socket

    url, ctx = server
    engine = ctx.workers["llama"]
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "llama", "prompt": "the cat", "max_tokens": 40, "temperature": 0,
                       "stream": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    stalled = []
    try:
        for _ in range(6):
            connection = socket.create_connection((host, int(port)))
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            connection.sendall(request)
            stalled.append(connection)
        deadline = time.time() + 20
        while (engine.running or len(engine)) and time.time() < deadline:
            time.sleep(0.02)
        assert engine.running == [] and len(engine) == 0
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=20)
        assert client.completions.create(model="llama", prompt="a dog", max_tokens=3).usage.completion_tokens >= 1
    finally:
        for connection in stalled:
            connection.close()


def test_each_model_thread_takes_its_threads_and_warms_its_kernels_before_any_request(dirs, monkeypatch):
    """Every model runs on a thread of its own (serve/run.py keeps the main thread at one torch thread):
    that thread takes the server's --threads and warms the kernels there, before the server answers."""
    from atencion.serve import app as served

    seen = []
    monkeypatch.setattr(served, "warm", lambda m: seen.append((m.name, threading.current_thread().name,
                                                               torch.get_num_threads())))
    with serving([f"llama={dirs['llama']}", f"bert={dirs['bert']}"], threads=1) as (url, _):
        assert sorted(seen) == [("bert", "worker-bert_0", 1), ("llama", "engine-llama", 1)]
        assert httpx.get(url + "/health").status_code == 200

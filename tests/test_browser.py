"""The attention explorer page (GET /) in headless Chromium, driven by Playwright.

A real server (`python -m atencion serve`) on a free loopback port serves the demo model; the
page is typed into and clicked like a person would, and what it shows is checked against the
API's own answer. Needs Debian's chromium at /usr/bin/chromium and the playwright package
(Playwright's own browser download is not used); skipped with the reason when either is missing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
# Flags Chromium needs on these machines: root (no sandbox), no GPU, a small /dev/shm, and no
# background connections (the network is closed; they would only fail, many at a time).
CHROMIUM_ARGS = ["--no-sandbox", "--headless=new", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SENTENCE = "el gato negro come el ratón"
TRANSLATION = "the black cat eats the mouse"
KEY = "s3cret-key"

if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):  # as scripts/test.sh's [ -x ] sees it
    pytest.skip(f"{CHROMIUM} is missing or not executable (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")


# --- a server in a subprocess ------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(url: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"X-API-Key": key} if key else {})
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


class Server:
    """`python -m atencion serve` on a free port until stop(); ``url`` ends with '/'."""

    def __init__(self, model_dir: Path, log: Path, *extra: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "atencion", "serve", "--model", f"demo={model_dir}", "--host", "127.0.0.1",
                 "--port", str(self.port), "--threads", "1", *extra], stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 90
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited ({self.process.returncode}): {log.read_text()}")
            try:
                if _request(self.url + "health")[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the server did not answer /health within 90 s: {log.read_text()}")
            time.sleep(0.2)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    srv = Server(Path(demo_model_dir), tmp_path_factory.mktemp("serve") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.set_default_timeout(20_000)
    yield pg
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def _translate(page, sentence: str = SENTENCE) -> None:
    page.fill("#sentence", sentence)
    page.press("#sentence", "Enter")  # Enter submits


# --- the tests -----------------------------------------------------------------------------------

def test_translate_explore_attention_and_alignment(page, server, tmp_path):
    page.goto(server.url)
    from atencion.viz.attention import CAUTION
    assert page.inner_text("#caution") == CAUTION
    _translate(page)
    page.wait_for_function("document.querySelector('#translation').textContent.includes('the black cat')")
    assert page.inner_text("#translation") == TRANSLATION
    nbest = page.locator("#nbest li")
    assert nbest.count() == 3
    assert TRANSLATION in nbest.first.inner_text()

    status, answer = _request(server.url + "translate", {"sentences": [SENTENCE], "beam": 4, "nbest": 3,
                                                          "attention": True})
    assert status == 200, answer
    attention = answer["translations"][0]["attention"]
    scores = [h["score"] for h in answer["translations"][0]["nbest"]]
    assert [float(s.inner_text()) for s in page.locator("#nbest li .score").all()] == pytest.approx(scores, abs=1e-4)

    # the cross-attention grid: layers × heads (+ a mean column), labelled
    page.select_option("#kind", "cross")
    page.select_option("#units", "pieces")
    cross = attention["pieces"]["cross"]
    layers, heads = len(cross["weights"]), len(cross["weights"][0])
    assert page.locator("#grid td.head").count() == layers * (heads + 1)
    assert page.locator("#grid tbody th").all_inner_texts() == [f"layer {i + 1}" for i in range(layers)]

    # enlarge one head: every cell is the API's weight, tokens on both axes, hover text
    layer, head = layers - 1, heads - 1
    page.click(f"#grid td.head[data-layer='{layer}'][data-head='{head}']")
    page.wait_for_selector(f"#enlarged[data-layer='{layer}'][data-head='{head}']")
    assert page.locator("#enlarged th.row-label").all_inner_texts() == cross["rows"]
    assert page.locator("#enlarged th.col-label").all_inner_texts() == cross["cols"]
    shown = page.eval_on_selector_all(
        "#enlarged td[data-weight]", "cells => cells.map(c => [+c.dataset.row, +c.dataset.col, +c.dataset.weight])")
    expected = cross["weights"][layer][head]
    assert len(shown) == len(expected) * len(expected[0])
    for i, j, w in shown:
        assert abs(w - expected[i][j]) <= 1e-6, (i, j, w, expected[i][j])
    page.hover("#enlarged td[data-row='1'][data-col='2']")
    assert page.inner_text("#hover") == f"{cross['rows'][1]} → {cross['cols'][2]}: {expected[1][2]:.4f}"

    # the alignment: "black" (target word 1) is linked to "negro" (source word 2), as the API says
    lines = page.locator("#alignment line[data-src]")
    assert lines.count() == len(attention["alignment"])
    drawn = sorted([int(line.get_attribute("data-src")), int(line.get_attribute("data-tgt"))] for line in lines.all())
    assert drawn == sorted(attention["alignment"])
    black = page.locator("#alignment line[data-tgt-word='black']")
    assert black.count() == 1
    assert black.get_attribute("data-src-word") == "negro"
    assert (black.get_attribute("data-src"), black.get_attribute("data-tgt")) == ("2", "1")
    # the words in their rows, and every line drawn from its source word to its target word
    assert page.locator("#alignment text.word.src").all_text_contents() == SENTENCE.split()
    assert page.locator("#alignment text.word.tgt").all_text_contents() == TRANSLATION.split()
    ends = page.eval_on_selector_all("#alignment line[data-src]", """lines => lines.map(l => {
        const word = (side, i) => document.querySelector(`#alignment text.word.${side}[data-index="${i}"]`);
        const s = word("src", l.dataset.src), t = word("tgt", l.dataset.tgt);
        return [+l.getAttribute("x1") - +s.getAttribute("x"), +l.getAttribute("x2") - +t.getAttribute("x"),
                s.textContent === l.dataset.srcWord, t.textContent === l.dataset.tgtWord];
    })""")
    assert ends == [[0, 0, True, True]] * len(attention["alignment"])

    # pieces → words: the labels follow ("▁black" → "black"), the head stays enlarged
    words = attention["words"]["cross"]
    assert words["rows"] != cross["rows"]
    page.select_option("#units", "words")
    page.wait_for_function("document.querySelector('#grid').dataset.rows.indexOf('▁') < 0")
    assert json.loads(page.get_attribute("#grid", "data-rows")) == words["rows"]
    assert page.locator("#enlarged th.row-label").all_inner_texts() == words["rows"]
    cell = page.locator("#enlarged td[data-row='1'][data-col='2']")
    assert abs(float(cell.get_attribute("data-weight")) - words["weights"][layer][head][1][2]) <= 1e-6
    page.select_option("#units", "pieces")
    assert json.loads(page.get_attribute("#grid", "data-rows")) == cross["rows"]

    # the other kinds: encoder self-attention is source × source
    page.select_option("#kind", "encoder")
    assert page.locator("#enlarged th.row-label").all_inner_texts() == attention["pieces"]["encoder"]["rows"]
    page.select_option("#kind", "cross")

    page.screenshot(path=str(tmp_path / "explorer.png"), full_page=True)
    page.screenshot(path="/tmp/explorer.png", full_page=True)


def test_api_error_is_shown(page, server):
    page.goto(server.url)
    page.wait_for_function("document.querySelector('#model').options.length > 0")
    assert page.locator("#error").is_hidden()
    assert page.locator("#model").is_hidden()  # one model: no selector, its name in #model-info
    assert "demo" in page.inner_text("#model-info")
    _translate(page, "   ")
    page.wait_for_selector("#error:not([hidden])")
    status, answer = _request(server.url + "translate", {"sentences": ["   "]})
    assert status == 422
    assert page.inner_text("#error") == answer["error"] == "sentences.0: the sentence is empty"
    # a bad setting is the server's to judge, and its message is shown too
    page.fill("#beam", "2")
    page.fill("#nbest-size", "3")
    _translate(page)
    page.wait_for_function("document.querySelector('#error').textContent.includes('nbest')")
    assert page.inner_text("#error") == "nbest: 3 is more than beam (2)"
    # and a good request clears it
    page.fill("#nbest-size", "2")
    _translate(page)
    page.wait_for_function("document.querySelector('#translation').textContent.includes('the black cat')")
    assert page.locator("#error").is_hidden()
    assert page.locator("#nbest li").count() == 2


def test_api_key_and_two_models(browser, demo_model_dir, tmp_path):
    """With --api-key, the page at /?key=KEY loads its script and sends the key on every request;
    with two models, a selector picks the one that translates."""
    srv = Server(Path(demo_model_dir), tmp_path / "server.log", "--api-key", KEY,
                 "--model", f"second={demo_model_dir}")
    context = browser.new_context()
    try:
        pg = context.new_page()
        pg.set_default_timeout(20_000)
        assert _request(srv.url + "translate", {"sentences": [SENTENCE]})[0] == 401
        pg.goto(f"{srv.url}?key={KEY}")
        pg.wait_for_function("document.querySelector('#model').options.length == 2")
        assert pg.locator("#model").is_visible()
        pg.select_option("#model", "second")
        _translate(pg)
        pg.wait_for_function("document.querySelector('#translation').textContent.includes('the black cat')")
        assert pg.inner_text("#status").startswith("second:")
        assert pg.locator("#alignment line[data-src]").count() > 0
        assert pg.locator("#error").is_hidden()
        # without the key the page is refused, and says so
        status, answer = _request(srv.url + "info")
        assert status == 401
        pg.goto(srv.url)
        assert answer["error"] in pg.content()
    finally:
        context.close()
        srv.stop()


def test_a_hugging_face_bert_s_heads_are_explored(page, tmp_path):
    """A Hugging Face BERT directory, served as it is: the page asks /attention and draws its
    encoder self-attention, layers × heads, with the tokenizer's own pieces ([CLS] … [SEP])."""
    transformers = pytest.importorskip("transformers")
    from test_hf_dirs import wordpiece

    tokenizer = wordpiece()
    transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=0)).save_pretrained(tmp_path / "bert")
    tokenizer.save_pretrained(tmp_path / "bert")
    srv = Server(tmp_path / "bert", tmp_path / "server.log")
    try:
        page.goto(srv.url)
        page.wait_for_function("document.querySelector('#translate').textContent === 'Show attention'")
        assert page.locator("#error").is_hidden()
        _translate(page, "the cat sat on the mat.")
        page.wait_for_selector("#attention:not([hidden])")
        status, answer = _request(srv.url + "attention", {"text": "the cat sat on the mat."})
        assert status == 200, answer
        encoder = answer["attention"]["pieces"]["encoder"]
        assert encoder["rows"][0] == "[CLS]" and encoder["rows"][-1] == "[SEP]"
        assert page.input_value("#kind") == "encoder" and page.locator("#kind option[value='cross']").is_disabled()
        assert page.locator("#grid td.head").count() == 2 * (4 + 1)
        assert page.locator("#enlarged th.row-label").all_inner_texts() == encoder["rows"]
        assert page.inner_text("#translation") == "the cat sat on the mat."
    finally:
        srv.stop()


def test_a_vits_uploaded_image_gets_its_label_and_rollout_heatmap(page, tmp_path):
    """A ViT served: the page offers an image upload instead of a sentence; the PNG chosen goes to
    /classify (multipart, attention=true) and its label and [CLS] rollout over the patch grid are
    drawn: the cells the page draws are the rollout `capture_input_attention` computes."""
    import numpy as np
    from PIL import Image

    from atencion.data.images import read_image
    from atencion.nn.model_dir import save_model_dir
    from atencion.viz.attention import capture_input_attention
    from test_input_attention import _vit

    model = _vit()
    save_model_dir(tmp_path / "vit", model, None)
    pixels = (np.random.default_rng(0).random((4, 6)) * 255).astype(np.uint8)
    Image.fromarray(pixels, mode="L").save(tmp_path / "digit.png")
    expected = capture_input_attention(model, None, read_image(tmp_path / "digit.png", 1, (4, 6)))
    srv = Server(tmp_path / "vit", tmp_path / "server.log")
    try:
        page.goto(srv.url)
        page.wait_for_selector("#upload-panel:not([hidden])")
        assert page.locator("#error").is_hidden() and page.locator("#translate").is_disabled()
        page.set_input_files("#upload-file", str(tmp_path / "digit.png"))
        page.click("#upload")
        page.wait_for_selector("#rollout-canvas")
        cells = json.loads(page.get_attribute("#rollout-canvas", "data-cells"))
        np.testing.assert_allclose(cells, expected.rollout[0, 1:], atol=1e-5)
        assert len(cells) == 6 and page.inner_text("#upload-label").strip()
    finally:
        srv.stop()


def test_a_gpts_induction_heads_are_outlined_with_their_scores(page, tmp_path):
    """The hand-built two-layer attention-only GPT of test_induction.py served: with "induction
    heads" ticked, the page asks /attention with induction: true and writes each head's
    prefix-matching and copying scores under its heatmap, outlining the one induction head."""
    from atencion.data.tokenizer import Tokenizer
    from atencion.nn.model_dir import save_model_dir
    from test_induction import hand_built

    save_model_dir(tmp_path / "gpt", hand_built(), Tokenizer.train_text(["abcdefghijklmno\n"], kind="char"))
    srv = Server(tmp_path / "gpt", tmp_path / "server.log")
    try:
        page.goto(srv.url)
        page.wait_for_selector("#induction-label:not([hidden])")
        page.check("#induction")
        _translate(page, "abcdeabcde")
        page.wait_for_selector("#induction-note:not([hidden])")
        status, answer = _request(srv.url + "attention", {"text": "abcdeabcde", "induction": True})
        assert status == 200 and answer["induction"]["induction_heads"] == [[1, 0]], answer
        outlined = page.locator("#grid td.head.induction")
        assert outlined.count() == 1
        assert (outlined.get_attribute("data-layer"), outlined.get_attribute("data-head")) == ("1", "0")
        p, c = answer["induction"]["prefix_matching"][1][0], answer["induction"]["copying"][1][0]
        assert outlined.locator(".scores").inner_text() == f"P {p:.2f} · C {c:.2f}"
        assert page.locator("#grid .scores").count() == 2 * 2
    finally:
        srv.stop()

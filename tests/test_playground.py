"""The playground page (GET /, server/static/) in a real headless Chromium (Debian's `chromium` and
`chromium-driver`, driven by Selenium; `make test` installs them where it runs as root with apt) against
a live server on loopback: streamed tokens and their depth colours equal what the API answers to the
same seeded request; a bad knob value and a full server show the server's own message; Stop aborts the
request on the server (its pages freed); the plain SmolLM2 behind an API key says it has no depth knobs.

demo-dreamer runs the server's confidence policy (`--depth-policy confidence --confidence-threshold 0.99`):
each sampled token of a ranged request stops at the first depth whose readout is 99% sure of its top-1
token, which depends only on the token and its prefix, so a seeded request runs the same depths every time
(and they vary: the answer to a question of h hops runs depth h, the statements the model goes on writing
mostly depth 1).

With DEPTHSERVE_PLAYGROUND_SCREENSHOT=docs/playground.png the Stop test saves the page mid-generation
there (the README's screenshot)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

pytest.importorskip("uvicorn")

from depthserve.config import EngineArgs  # noqa: E402
from depthserve.engine.async_llm import AsyncLLM  # noqa: E402
from depthserve.engine.llm_engine import LLMEngine  # noqa: E402
from depthserve.server.app import build_app  # noqa: E402
from tests.live_server import live_server, metric_value, wait_idle  # noqa: E402

PROMPT = "k=3 c=7 p=k w=1 m=w d=p y=c t=y t?"  # a demo-dreamer problem (depthserve/demo/task.py): t -> y -> c = 7
HOPS = 3  # ... three hops, so the answer " 7" runs depth 3 under the confidence policy at 0.99
# demo-dreamer answers, then repeats </s>: with </s> (id 2) banned it goes on writing statements (a stream
# of visible tokens), through the page's "More fields" box.
NO_EOS = '{"logit_bias": {"2": -100}}'
ENGINE = dict(device="cpu", dtype="float32", load_progress=False, kv_cache_memory_gib=0.05)


def _browser_paths() -> tuple[str, str]:
    """Chromium and its driver, or a skip that says what is missing."""
    pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[test]')")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("the playground test needs Debian's chromium and chromium-driver (apt-get install chromium "
                    "chromium-driver; `make test` does it when run as root with apt-get)")
    return chromium, driver


@pytest.fixture(scope="module")
def browser():
    chromium, driver = _browser_paths()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1360,1000", "--force-color-profile=srgb"):
        options.add_argument(flag)
    page = webdriver.Chrome(options=options, service=Service(executable_path=driver))
    yield page
    page.quit()


class Paced:
    """The engine's own depth policy with a pause before every step, so that the browser can watch a
    generation and stop it; nothing else changes (the levels, name and target are the policy's)."""

    def __init__(self, policy, pause: float) -> None:
        self.policy, self.pause = policy, pause

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def target(self):
        return self.policy.target

    def assign(self, scheduled):
        time.sleep(self.pause)
        return self.policy.assign(scheduled)

    def observe(self, scheduled, seconds) -> None:
        self.policy.observe(scheduled, seconds)


@contextmanager
def paced(llm, pause: float = 0.05):
    """Every engine step waits `pause` seconds first, until the block ends and the engine is idle."""
    policy = llm.engine.depth_policy
    llm.engine.depth_policy = Paced(policy, pause)
    try:
        yield
    finally:
        llm.engine.depth_policy = policy
        wait_idle(llm)


@pytest.fixture(scope="module")
def demo():
    """demo-dreamer on loopback under the confidence policy: one request runs at a time and none may
    wait (a second one is a 503)."""
    engine = LLMEngine(EngineArgs(model="demo-dreamer", max_model_len=128, max_num_seqs=1, depth_policy="confidence",
                                  confidence_threshold=0.99, **ENGINE))
    assert engine.depth_policy.name == "confidence"
    llm = AsyncLLM(engine, max_waiting_requests=0)
    with live_server(build_app(llm)) as base:
        yield base, llm


# ---- driving the page ---------------------------------------------------------------------------------
def _by(css: str):
    from selenium.webdriver.common.by import By

    return By.CSS_SELECTOR, css


def _wait(page, condition, timeout: float = 30):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(page, timeout, poll_frequency=0.05).until(condition)


def _open(page, base: str, model: str | None = None) -> None:
    page.get(f"{base}/")
    if model is not None:
        from selenium.webdriver.support.ui import Select

        _wait(page, lambda p: p.find_elements(*_by(f'#model option[value="{model}"]')))
        Select(page.find_element(*_by("#model"))).select_by_value(model)


def _type(element, value) -> None:
    element.clear()
    element.send_keys(str(value))


def _fill(page, **fields) -> None:
    for name, value in fields.items():
        _type(page.find_element(*_by(f"#{name.replace('_', '-')}")), value)


def _check(page, element_id: str) -> None:
    box = page.find_element(*_by(f"#{element_id}"))
    if not box.is_selected():
        box.click()


def _depth_range(page, knob: str, low: int, high: int) -> None:
    from selenium.webdriver.support.ui import Select

    box = page.find_element(*_by(f'#knobs .knob[data-knob="{knob}"]'))
    Select(box.find_element(*_by(".knob-mode"))).select_by_value("range")
    low_field, high_field = box.find_elements(*_by(".knob-range input[type=number]"))
    _type(low_field, low)
    _type(high_field, high)


def _generate(page) -> str:
    """Click Generate and wait for the end: done, error or stopped."""
    page.find_element(*_by("#generate")).click()
    _wait(page, lambda p: p.find_element(*_by("#status")).get_attribute("data-state") in ("done", "error", "stopped"))
    return page.find_element(*_by("#status")).get_attribute("data-state")


def _sent_body(page) -> dict:
    """The body the page sent (it shows it under "Last request body")."""
    return json.loads(page.find_element(*_by("#request-json")).get_attribute("textContent"))


def _unstreamed(body: dict) -> dict:
    return {key: value for key, value in body.items() if key not in ("stream", "stream_options")}


def _tokens(page) -> list:
    return page.find_elements(*_by("#output .tok"))


def _depths(span) -> list[int]:
    return [int(d) for d in (span.get_attribute("data-depth") or "").split(",") if d]


# ---- the tests --------------------------------------------------------------------------------------
def test_the_page_needs_no_key_and_nothing_from_elsewhere(demo):
    """Without a browser too: / and its assets are served to anyone (the API keeps its key), and
    they name no other site (no CDN: the page works offline)."""
    from fastapi.testclient import TestClient

    _, llm = demo
    client = TestClient(build_app(llm, api_key="secret"))  # no lifespan: the shared engine stays up
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for asset in ("playground.js", "playground.css"):
        assert f'"static/{asset}"' in page.text
        answer = client.get(f"/static/{asset}")
        assert answer.status_code == 200 and "http://" not in answer.text and "https://" not in answer.text
    assert "http://" not in page.text and "https://" not in page.text
    docs = client.get("/docs")  # the API docs too: their assets are this server's
    assert docs.status_code == 200 and "http://" not in docs.text and "https://" not in docs.text
    assert client.get("/docs-assets/swagger-ui-bundle.js").status_code == 200
    assert client.get("/v1/models").status_code == 401
    missing = client.get("/static/missing.js")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_the_api_docs_render_from_this_server_alone(browser, demo):
    """/docs is Swagger UI on the swagger-ui-py package's assets, served by this server: it lists
    the API's routes with every resource it loads coming from this server (no CDN: it works offline),
    and sends the schema to no validator."""
    base, _ = demo
    browser.get(f"{base}/docs")
    _wait(browser, lambda p: p.find_elements(*_by(".opblock-summary-path")))
    paths = {element.get_attribute("data-path") for element in browser.find_elements(*_by(".opblock-summary-path"))}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= paths
    assert "depthserve" in browser.find_element(*_by(".info .title")).text
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map(entry => entry.name)")
    assert f"{base}/openapi.json" in loaded and f"{base}/docs-assets/swagger-ui-bundle.js" in loaded
    assert all(url.startswith(base + "/") for url in loaded), loaded
    assert not browser.find_elements(*_by(".errors-wrapper"))


def test_streamed_tokens_and_their_depth_colours_equal_the_api(browser, demo):
    from selenium.webdriver.common.action_chains import ActionChains

    base, _ = demo
    _open(browser, base, "demo-dreamer")
    _depth_range(browser, "depth", 1, 6)
    _fill(browser, prompt=PROMPT, max_tokens=24, temperature=1.0, seed=11, extra=NO_EOS)
    _check(browser, "top")
    assert _generate(browser) == "done"
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map(r => r.name)")
    assert loaded and all(url.startswith(f"{base}/") for url in loaded)  # nothing from elsewhere

    body = _sent_body(browser)
    assert body["depth"] == {"depth": {"min": 1, "max": 6}} and body["seed"] == 11 and body["stream"] is True
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert f'`"depth": {json.dumps(body["depth"])}`' in readme  # the screenshot's caption shows this request
    assert body["logit_bias"] == {"2": -100}
    api = httpx.post(f"{base}/v1/completions", json=_unstreamed(body), timeout=30).json()
    choice = api["choices"][0]
    spans = _tokens(browser)
    assert "".join(s.get_attribute("textContent") for s in spans) == choice["text"]
    assert [d for s in spans for d in _depths(s)] == choice["token_depths"]
    assert len(choice["token_depths"]) == 24 and len(set(choice["token_depths"])) >= 3
    assert choice["text"].startswith(" 7") and choice["token_depths"][0] == HOPS  # the answer: one depth a hop
    assert len(spans) == 24  # one span per token

    # The legend: one colour per level of the knob's range, each token in its (deepest) level's colour.
    legend = {int(s.get_attribute("data-level")): s.value_of_css_property("background-color")
              for s in browser.find_elements(*_by("#legend .swatch"))}
    assert sorted(legend) == [1, 2, 3, 4, 5, 6] and len(set(legend.values())) == 6
    assert [s.value_of_css_property("background-color") for s in spans] == [legend[max(_depths(s))] for s in spans]

    summary = browser.find_element(*_by("#summary")).text
    assert summary.startswith("24 tokens") and "first token after" in summary
    assert ("tokens/s" in summary) != ("last after" in summary)  # a rate, or (too short to rate) the last token's time
    assert f"relative compute {api['usage']['depth']['relative_compute']:.2f}" in summary

    # Hovering a token shows its depth, its logprob and the alternatives.
    token = next(s for s in spans if s.get_attribute("textContent"))
    ActionChains(browser).move_to_element(token).perform()
    tip = _wait(browser, lambda p: p.find_element(*_by("#tip")) if p.find_element(*_by("#tip")).is_displayed() else None)
    index = spans.index(token)
    assert f"depth {choice['token_depths'][index]} of 1–6" in tip.text
    shown = re.search(r"logprob (-?\d+\.\d+)", tip.text)
    assert shown and float(shown.group(1)) == pytest.approx(choice["logprobs"]["token_logprobs"][index], abs=1e-3)
    assert "top alternatives" in tip.text
    _wait(browser, lambda p: p.find_element(*_by("#m-target")).text.startswith("confidence: each token stops"))
    assert re.search(r"now run at most \d+ levels", browser.find_element(*_by("#m-target")).text)  # the panel


def test_chat_is_offered_only_for_a_model_with_a_chat_template(browser, demo):
    base, _ = demo
    card = httpx.get(f"{base}/v1/models").json()["data"][0]
    assert card["id"] == "demo-dreamer" and card["supports_chat"] is False  # its tokenizer has no chat template
    _open(browser, base, "demo-dreamer")
    assert not browser.find_element(*_by("input[name=mode][value=chat]")).is_enabled()
    assert browser.find_element(*_by("input[name=mode][value=completion]")).is_selected()
    assert "no chat template" in browser.find_element(*_by("#mode-note")).text


def test_a_bad_knob_value_shows_the_servers_message(browser, demo):
    base, _ = demo
    _open(browser, base, "demo-dreamer")
    _depth_range(browser, "depth", 5, 2)
    _fill(browser, prompt=PROMPT)
    assert _generate(browser) == "error"
    answer = httpx.post(f"{base}/v1/completions", json=_unstreamed(_sent_body(browser)))
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert "above its max" in message
    assert browser.find_element(*_by("#error")).text == f"400: {message}"
    assert browser.find_element(*_by("#generate")).is_enabled()  # the page goes on


def test_a_full_server_shows_503_and_retry_after(browser, demo):
    base, llm = demo
    with paced(llm), httpx.Client(timeout=30) as client:  # the one running slot, taken by another client
        held = client.send(client.build_request("POST", f"{base}/v1/completions", json={
            "model": "demo-dreamer", "prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "stream": True}),
            stream=True)
        _open(browser, base, "demo-dreamer")
        _fill(browser, prompt=PROMPT)
        assert _generate(browser) == "error"
        error = browser.find_element(*_by("#error")).text
        held.close()
    assert error.startswith("503: ") and "try again later" in error
    assert "retry after 1 s" in error


def test_stop_aborts_the_request_on_the_server(browser, demo):
    from selenium.webdriver.common.action_chains import ActionChains

    base, llm = demo
    aborted = metric_value(base, "depthserve_requests_total", outcome="aborted")
    with paced(llm):
        _open(browser, base, "demo-dreamer")
        _depth_range(browser, "depth", 1, 6)
        _fill(browser, prompt=PROMPT, max_tokens=100, temperature=1.0, seed=5, extra=NO_EOS)
        _check(browser, "top")
        browser.find_element(*_by("#generate")).click()
        _wait(browser, lambda p: len(_tokens(p)) >= 30)
        # The live panel sees the running request and the pages it holds.
        _wait(browser, lambda p: p.find_element(*_by("#m-running")).text == "1")
        assert not browser.find_element(*_by("#m-kv")).text.startswith("0 /")
        if os.environ.get("DEPTHSERVE_PLAYGROUND_SCREENSHOT"):  # the answer's depth, and its alternatives
            browser.execute_script("window.scrollTo(0, 0)")
            ActionChains(browser).move_to_element(_tokens(browser)[0]).perform()
            _wait(browser, lambda p: p.find_element(*_by("#tip")).is_displayed())
            browser.save_screenshot(os.environ["DEPTHSERVE_PLAYGROUND_SCREENSHOT"])
        browser.find_element(*_by("#stop")).click()
        _wait(browser, lambda p: p.find_element(*_by("#status")).get_attribute("data-state") == "stopped")
    assert len(_tokens(browser)) < 100
    assert metric_value(base, "depthserve_requests_total", outcome="aborted") == aborted + 1
    assert metric_value(base, "depthserve_requests_running") == 0
    assert metric_value(base, "depthserve_kv_pages_used") == 0  # the aborted request's pages are back
    _wait(browser, lambda p: p.find_element(*_by("#m-kv")).text.startswith("0 /"))


def test_plain_smollm2_behind_an_api_key_has_no_depth_knobs(browser):
    engine = LLMEngine(EngineArgs(model="smollm2-135m-instruct", max_model_len=256, **ENGINE))
    with live_server(build_app(AsyncLLM(engine), api_key="secret")) as base:
        _open(browser, base)  # the page itself needs no key
        _wait(browser, lambda p: p.find_element(*_by("#key-row")).is_displayed())
        assert "API key" in browser.find_element(*_by("#error")).text
        _type(browser.find_element(*_by("#api-key")), "secret")
        browser.find_element(*_by("#connect")).click()
        _wait(browser, lambda p: p.find_elements(*_by('#model option[value="smollm2-135m-instruct"]')))
        assert "This model has no depth knobs" in browser.find_element(*_by("#knobs")).text
        assert "No depth knobs" in browser.find_element(*_by("#legend")).text
        assert not browser.find_element(*_by("#error")).is_displayed()

        chat = browser.find_element(*_by("input[name=mode][value=chat]"))
        assert chat.is_enabled() and not browser.find_element(*_by("#mode-note")).is_displayed()
        chat.click()
        _fill(browser, prompt="What is the capital of France?", max_tokens=6, seed=3)
        assert _generate(browser) == "done"
        body = _sent_body(browser)
        api = httpx.post(f"{base}/v1/chat/completions", json=_unstreamed(body), timeout=60,
                         headers={"Authorization": "Bearer secret"}).json()
        spans = _tokens(browser)
        assert "".join(s.get_attribute("textContent") for s in spans) == api["choices"][0]["message"]["content"]
        assert len(spans) == api["usage"]["completion_tokens"]
        assert not any(s.get_attribute("data-depth") for s in spans)


def test_the_json_schema_box_holds_the_reply_to_the_schema(browser, demo):
    base, _ = demo
    _open(browser, base, "demo-dreamer")
    schema = {"type": "integer", "minimum": 0, "maximum": 9}  # the demo's word-level vocabulary has digits
    _fill(browser, prompt=PROMPT, max_tokens=20, temperature=0, json_schema=json.dumps(schema))
    assert _generate(browser) == "done"
    body = _sent_body(browser)
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "playground", "schema": schema}}
    text = "".join(token.get_attribute("textContent") for token in _tokens(browser))
    assert 0 <= json.loads(text) <= 9


def test_a_token_without_text_is_explained_in_its_tooltip(browser, demo):
    from selenium.webdriver.common.action_chains import ActionChains

    base, _ = demo
    _open(browser, base, "demo-dreamer")
    _fill(browser, prompt=PROMPT, max_tokens=6, temperature=0)
    assert _generate(browser) == "done"
    empty = [span for span in _tokens(browser) if not span.get_attribute("textContent")]
    assert empty, "the demo answers, then ends its sequence"
    # Shown as its own token (demo-dreamer's </s>, from the streamed logprobs) in a tag drawn by CSS, not
    # as a glyph, and not in the reply's text.
    api = httpx.post(f"{base}/v1/completions", json=_unstreamed(_sent_body(browser)), timeout=30).json()
    tokens = api["choices"][0]["logprobs"]["tokens"]
    end = tokens[[span.get_attribute("textContent") for span in _tokens(browser)].index("")]
    assert end == "</s>"
    shown = browser.execute_script("return getComputedStyle(arguments[0], '::after').content", empty[-1])
    assert shown == json.dumps(end) and empty[-1].get_attribute("data-label") == end
    ActionChains(browser).move_to_element(empty[-1]).perform()
    tip = _wait(browser, lambda p: p.find_element(*_by("#tip")) if p.find_element(*_by("#tip")).is_displayed() else None)
    assert tip.text.startswith(f"{end}: a token with no text (such as the end of sequence)")


def test_the_rate_is_shown_only_over_an_interval_long_enough_to_measure(browser, demo):
    """12 tokens arriving within half a millisecond are no 22,000 tokens/s: the summary gives the last
    token's time instead; over a second, the tokens after the first chunk over the time they took."""
    base, _ = demo
    _open(browser, base)

    def summary(**run) -> str:
        run = {"tokens": 12, "afterFirst": 11, "depths": [], "start": 0, "first": 100, "usage": None, "ended": True, **run}
        browser.execute_script("updateSummary(arguments[0])", run)
        return browser.find_element(*_by("#summary")).text

    burst = summary(last=100.5)
    assert "tokens/s" not in burst and burst == "12 tokens · first token after 100 ms · last after 101 ms"
    assert summary(last=1200) == "12 tokens · 10.0 tokens/s · first token after 100 ms"
    assert summary(last=100.5, ended=False) == "12 tokens · first token after 100 ms"  # still streaming

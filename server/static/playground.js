// depthserve playground: one page over this server's own API (same origin, no libraries, nothing
// fetched from elsewhere). Streams a completion or a chat reply, colours every token by the depth
// it ran at (`token_depths` of each streamed chunk), and polls /metrics for a small live panel.
"use strict";

const $ = (id) => document.getElementById(id);
const METRICS_EVERY_MS = 1000;
// A tokens/s figure needs the stream to have lasted this long after its first tokens: over a shorter
// interval (a short reply, several tokens to a chunk) it measures the stream's buffering, not decoding.
const MIN_RATE_INTERVAL_MS = 250;
const EXAMPLES = {demo: "c=4 x=8 f=c q=x h=f h?", chat: "Write a haiku about the sea."};

const state = {
  models: [],         // the data of GET /v1/models
  controller: null,   // the AbortController of the generation in flight
  history: [],        // chat turns sent with the next message
  legend: null,       // {knob, lo, hi}: the levels the palette spans (null: no per-token depth)
  info: new WeakMap(),  // token span -> {text, depths, logprobs}
};

// ---- small helpers --------------------------------------------------------------------------------
function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key.includes("-")) node.setAttribute(key, value);  // aria-*, data-*
    else node[key] = value;
  }
  node.append(...children);
  return node;
}

const note = (text) => el("p", {className: "note", textContent: text});
const visible = (text) => JSON.stringify(text);  // a token's text with its spaces and newlines shown
const fmt = (x, digits = 2) => (Number.isFinite(x) ? x.toFixed(digits) : "–");

function numberField(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

function setStatus(text, phase) {
  $("status").textContent = text;
  $("status").dataset.state = phase;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

function hideError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

class ServerError extends Error {}

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? {Authorization: `Bearer ${key}`} : {};
}

/** The message of a non-2xx answer: the OpenAI error body's, and Retry-After when the server sends one. */
async function errorMessage(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body.error && body.error.message) message = `${response.status}: ${body.error.message}`;
  } catch { /* not JSON: the status line says what there is */ }
  const retry = response.headers.get("Retry-After");
  if (retry) message += ` (the server asks to retry after ${retry} s)`;
  return message;
}

// ---- models and depth knobs -----------------------------------------------------------------------
async function loadModels() {
  let response;
  try {
    response = await fetch("v1/models", {headers: authHeaders()});
  } catch (err) {
    showError(`cannot reach the server: ${err.message}`);
    return;
  }
  if (response.status === 401) {
    $("key-row").hidden = false;
    $("knobs").replaceChildren(el("legend", {textContent: "Depth knobs"}), note("Enter the API key to list the models."));
    showError(await errorMessage(response));
    $("api-key").focus();
    return;
  }
  if (!response.ok) {
    showError(await errorMessage(response));
    return;
  }
  hideError();
  state.models = (await response.json()).data;
  const select = $("model");
  const previous = select.value;
  select.replaceChildren(...state.models.map((m) => new Option(m.id, m.id)));
  if (state.models.some((m) => m.id === previous)) select.value = previous;
  if (!$("prompt").value) $("prompt").value = select.value.startsWith("demo-") ? EXAMPLES.demo : EXAMPLES.chat;
  renderModes();
  renderKnobs();
}

/** Chat only for a model with a chat template (the server would answer 400). */
function renderModes() {
  const model = currentModel();
  const chat = document.querySelector("input[name=mode][value=chat]");
  const supported = !model || model.supports_chat;
  chat.disabled = !supported;
  if (!supported && chat.checked) document.querySelector("input[name=mode][value=completion]").checked = true;
  $("mode-note").hidden = supported;
  $("mode-note").textContent = supported ? "" : "This model has no chat template: completions only.";
}

const currentModel = () => state.models.find((m) => m.id === $("model").value);

function knobRange(knob) {
  return knob.range ? knob.range : [knob.minimum, knob.maximum];
}

function renderKnobs() {
  const model = currentModel();
  const knobs = Object.values((model && model.depth_knobs) || {});
  const preset = (model && model.depth_preset) || null;
  const box = $("knobs");
  box.replaceChildren(el("legend", {textContent: "Depth knobs"}));
  if (!knobs.length) box.append(note("This model has no depth knobs: every token runs the whole model."));
  for (const knob of knobs) box.append(knobControl(knob, preset ? preset[knob.name] : undefined));
  $("preset-note").hidden = !preset;
  $("preset-note").textContent = preset
    ? `Preset depth ${JSON.stringify(preset)}; a knob set below overrides it, knob by knob.` : "";
  updateLegend();
}

/** A knob's controls: the model default (nothing sent), a fixed value, and for an elastic knob a
 * range or "auto". Sliders are paired with number fields, which are not clamped: the server checks
 * every value and its message says what is wrong. */
function knobControl(knob, presetValue) {
  const [lo, hi] = knobRange(knob);
  const ratios = knob.kind === "ratio_list";
  const step = ratios ? 0.05 : 1;
  const initial = typeof knob.default === "number" ? knob.default : hi;
  const box = el("div", {className: "knob", "data-knob": knob.name});
  const mode = el("select", {className: "knob-mode", "aria-label": `${knob.name}: how to set it`});
  const fallback = presetValue !== undefined ? `preset (${JSON.stringify(presetValue)})`
    : `model default (${JSON.stringify(knob.default)})`;
  mode.append(new Option(fallback, "default"), new Option("one value", "value"));
  if (knob.elastic) mode.append(new Option("range: depth per token", "range"), new Option("auto: the whole range", "auto"));

  const value = el("div", {className: "knob-value"});
  if (ratios) {
    for (let i = 0; i < (knob.length || 1); i++) {
      const start = Array.isArray(knob.default) ? knob.default[i] : hi;
      value.append(slider(`step ${i + 1}`, `${knob.name} step ${i + 1}`, lo, hi, step, start));
    }
  } else {
    value.append(slider(knob.kind === "int_or_map" ? "every layer" : "value", knob.name, lo, hi, step, initial));
  }
  const range = el("div", {className: "knob-range"},
    slider("min", `${knob.name} min`, lo, hi, step, lo), slider("max", `${knob.name} max`, lo, hi, step, hi));
  const sync = () => {
    value.hidden = mode.value !== "value";
    range.hidden = mode.value !== "range";
    updateLegend();
  };
  mode.addEventListener("change", sync);
  box.append(el("div", {className: "knob-name", textContent: `${knob.name} (${lo}–${hi})`}),
             note(knob.description), mode, value, range);
  sync();
  return box;
}

function slider(label, name, lo, hi, step, start) {
  const range = el("input", {type: "range", min: lo, max: hi, step, value: start, tabIndex: -1, "aria-hidden": "true"});
  const number = el("input", {type: "number", step, value: start, "aria-label": name});
  range.addEventListener("input", () => { number.value = range.value; });
  number.addEventListener("input", () => { range.value = number.value; });
  return el("label", {className: "slider"}, el("span", {textContent: label}), range, number);
}

/** The request's `depth` object from the knob controls (null: every knob at its default). */
function depthSettings() {
  const depth = {};
  for (const box of document.querySelectorAll("#knobs .knob")) {
    const numbers = (part) => [...box.querySelectorAll(`${part} input[type=number]`)].map((i) => Number(i.value));
    const name = box.dataset.knob;
    const mode = box.querySelector(".knob-mode").value;
    if (mode === "value") {
      const values = numbers(".knob-value");
      depth[name] = currentModel().depth_knobs[name].kind === "ratio_list" ? values : values[0];
    } else if (mode === "range") {
      const [min, max] = numbers(".knob-range");
      depth[name] = {min, max};
    } else if (mode === "auto") {
      depth[name] = "auto";
    }
  }
  return Object.keys(depth).length ? depth : null;
}

// ---- the legend: a sequential palette over the elastic knob's levels -------------------------------
/** Shallow tokens pale yellow, deep ones dark indigo (hue, saturation and lightness ramp together). */
function levelColour(level) {
  const {lo, hi} = state.legend;
  const t = hi > lo ? Math.min(1, Math.max(0, (level - lo) / (hi - lo))) : 1;
  return {background: `hsl(${Math.round(55 + 195 * t)} ${Math.round(85 - 30 * t)}% ${Math.round(86 - 54 * t)}%)`,
          color: t > 0.55 ? "#fff" : "#111"};
}

/** The legend of the selected model: its elastic knob's levels (none without one). */
function updateLegend() {
  const model = currentModel();
  const knob = Object.values((model && model.depth_knobs) || {}).find((k) => k.elastic);
  if (knob) {
    const [lo, hi] = knobRange(knob);
    state.legend = {knob: knob.name, lo, hi};
  } else {
    state.legend = null;
  }
  drawLegend();
}

/** Widen the legend to levels reported outside it (it is drawn from the knob's range, the levels
 * come from the server's `token_depths`). */
function coverLevels(depths) {
  const lo = Math.min(...depths);
  const hi = Math.max(...depths);
  const legend = state.legend || {knob: "depth", lo, hi};
  if (state.legend && lo >= legend.lo && hi <= legend.hi) return;
  state.legend = {...legend, lo: Math.min(lo, legend.lo), hi: Math.max(hi, legend.hi)};
  drawLegend();
}

function drawLegend() {
  const legend = $("legend");
  if (!state.legend) {
    const model = currentModel();
    const knobs = model && Object.keys(model.depth_knobs).length;
    legend.replaceChildren(note(knobs ? "This model's knobs take one value per request: no per-token depth to colour."
                                      : "No depth knobs: tokens are not coloured."));
    recolour();
    return;
  }
  const {knob, lo, hi} = state.legend;
  const swatches = [];
  for (let level = lo; level <= hi; level++) {
    const swatch = el("span", {className: "swatch", textContent: level, "data-level": level});
    Object.assign(swatch.style, levelColour(level));
    swatches.push(swatch);
  }
  legend.replaceChildren(el("span", {className: "legend-label", textContent: `${knob}: shallow`}), ...swatches,
                         el("span", {className: "legend-label", textContent: "deep (more compute)"}));
  const mode = document.querySelector(`#knobs .knob[data-knob="${knob}"] .knob-mode`);
  if (mode && mode.value !== "range" && mode.value !== "auto") {
    legend.append(note(`Set ${knob} to a range or auto for per-token depth.`));
  }
  recolour();
}

/** Each token span's colour from its (deepest) level; uncoloured where there is no legend. */
function recolour() {
  for (const span of document.querySelectorAll("#output .tok")) paint(span);
}

function paint(span) {
  const depths = state.info.get(span).depths;
  const colour = state.legend && depths && depths.length ? levelColour(Math.max(...depths)) : {background: "", color: ""};
  Object.assign(span.style, colour);
}

// ---- output ----------------------------------------------------------------------------------------
/** The logprobs of a chunk's tokens in one shape for both APIs: [{token, logprob, top: [[token, logprob]]}]. */
function chunkLogprobs(logprobs) {
  if (!logprobs) return null;
  if (logprobs.content) {  // chat
    return logprobs.content.map((t) => ({token: t.token, logprob: t.logprob,
                                         top: (t.top_logprobs || []).map((a) => [a.token, a.logprob])}));
  }
  return logprobs.tokens.map((token, i) => ({token, logprob: logprobs.token_logprobs[i],
                                             top: Object.entries((logprobs.top_logprobs || [])[i] || {})}));
}

/** A chunk's text cut along its tokens' texts (the space a detokenizer puts between words goes with
 * the token after it); a token whose text is not in the chunk's (end of sequence, a stop string)
 * gets "". null where the texts do not line up (a character split over several byte tokens). */
function splitByTokens(text, logprobs) {
  const pieces = [];
  let rest = text;
  for (const {token} of logprobs) {
    const at = token ? rest.indexOf(token) : -1;
    const piece = at >= 0 && rest.slice(0, at).trim() === "" ? rest.slice(0, at + token.length) : "";
    pieces.push(piece);
    rest = rest.slice(piece.length);
  }
  return rest === "" ? pieces : null;
}

/** A chunk's tokens as spans: one per token where the chunk's text splits along its tokens, else one
 * span for the whole chunk holding all of its tokens' depths. Returns the number of tokens. */
function addTokens(target, text, depths, logprobs) {
  const count = Math.max(depths ? depths.length : 0, logprobs ? logprobs.length : 0, text ? 1 : 0);
  const pieces = count === 1 ? [text] : logprobs && logprobs.length === count ? splitByTokens(text, logprobs) : null;
  if (pieces) {
    pieces.forEach((piece, i) => target.append(tokenSpan(piece, depths ? [depths[i]] : null,
                                                         logprobs ? [logprobs[i]] : null)));
  } else if (count) {
    target.append(tokenSpan(text, depths, logprobs));
  }
  return count;
}

/** What a token without text (the end of sequence, a stop string's) shows: its own token, such as
 * `</s>`, where the stream carried it (logprobs), else "end". */
function textlessLabel(logprobs) {
  const tokens = (logprobs || []).map((lp) => lp.token).filter(Boolean);
  return tokens.length ? tokens.join(" ") : "end";
}

function tokenSpan(text, depths, logprobs) {
  const span = el("span", {className: "tok", textContent: text});
  if (!text) {  // labelled by CSS (::after), so the reply's text stays what the server sent
    span.classList.add("textless");
    span.dataset.label = textlessLabel(logprobs);
  }
  if (depths && depths.length) {
    span.dataset.depth = depths.join(",");
    coverLevels(depths);
  }
  state.info.set(span, {text, depths, logprobs});
  paint(span);
  return span;
}

function startOutput(chat, prompt) {
  const output = $("output");
  if (!chat) output.replaceChildren(el("span", {className: "prompt", textContent: prompt}));
  else output.append(el("div", {className: "turn user", textContent: prompt}));
  const reply = el("div", {className: chat ? "turn assistant" : "completion"});
  output.append(reply);
  return reply;
}

/** The summary line. The rate counts the tokens that arrived after the first chunk over the time they
 * took, and only once that time is long enough to measure (MIN_RATE_INTERVAL_MS); a reply streamed
 * faster gives the time of its last token instead. */
function updateSummary(run) {
  const parts = [`${run.tokens} token${run.tokens === 1 ? "" : "s"}`];
  const streamed = run.first === null ? 0 : run.last - run.first;
  const rated = run.afterFirst > 0 && streamed >= MIN_RATE_INTERVAL_MS;
  if (rated) parts.push(`${fmt(run.afterFirst / (streamed / 1000), 1)} tokens/s`);
  if (run.first !== null) parts.push(`first token after ${Math.round(run.first - run.start)} ms`);
  if (run.first !== null && run.ended && !rated) parts.push(`last after ${Math.round(run.last - run.start)} ms`);
  if (run.depths.length) {
    const mean = run.depths.reduce((a, b) => a + b, 0) / run.depths.length;
    parts.push(`mean depth ${fmt(mean)}`);
  }
  const spent = run.usage && run.usage.depth;
  if (spent && spent.relative_compute !== undefined) parts.push(`relative compute ${fmt(spent.relative_compute)}`);
  $("summary").textContent = parts.join(" · ");
}

// ---- generating -------------------------------------------------------------------------------------
function requestBody(chat, prompt) {
  const body = {model: $("model").value, stream: true, stream_options: {include_usage: true}};
  const fields = {max_tokens: numberField("max-tokens"), temperature: numberField("temperature"),
                  top_p: numberField("top-p"), seed: numberField("seed")};
  for (const [name, value] of Object.entries(fields)) if (value !== undefined) body[name] = value;
  if ($("ignore-eos").checked) body.ignore_eos = true;
  const depth = depthSettings();
  if (depth) body.depth = depth;
  // Logprobs always: they carry each token's own text, which cuts a chunk into its tokens.
  const top = $("top").checked ? numberField("top-n") || 0 : 0;
  if (chat) {
    Object.assign(body, {messages: [...state.history, {role: "user", content: prompt}], logprobs: true, top_logprobs: top});
  } else {
    Object.assign(body, {prompt, logprobs: top});
  }
  const schema = jsonSchema();
  if (schema !== undefined) body.response_format = {type: "json_schema", json_schema: {name: "playground", schema}};
  return Object.assign(body, extraFields());  // the box has the last word
}

/** The "Output JSON schema" box: a schema the reply must match (the server checks it). */
function jsonSchema() {
  const text = $("json-schema").value.trim();
  if (!text) return undefined;
  try {
    return JSON.parse(text);
  } catch (err) {
    throw new Error(`"Output JSON schema" is not valid JSON: ${err.message}`);
  }
}

/** The "More fields" box: any other fields of the API (the server checks them). */
function extraFields() {
  const text = $("extra").value.trim();
  if (!text) return {};
  let fields;
  try {
    fields = JSON.parse(text);
  } catch (err) {
    throw new Error(`"More fields" is not valid JSON: ${err.message}`);
  }
  if (fields === null || typeof fields !== "object" || Array.isArray(fields)) {
    throw new Error('"More fields" must be a JSON object, such as {"top_k": 40}');
  }
  return fields;
}

/** The data of each server-sent event of a streamed response. */
async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data) yield data;
    }
  }
}

async function generate() {
  if (state.controller) return;
  if (!currentModel()) {
    showError("no model to ask: the model list has not loaded");
    return;
  }
  const chat = document.querySelector("input[name=mode]:checked").value === "chat";
  const prompt = $("prompt").value;
  let body;
  try {
    body = requestBody(chat, prompt);
  } catch (err) {
    showError(err.message);
    setStatus("error", "error");
    return;
  }
  $("request-json").textContent = JSON.stringify(body, null, 2);
  hideError();
  const reply = startOutput(chat, prompt);
  const run = {tokens: 0, afterFirst: 0, depths: [], text: "", start: performance.now(), first: null, last: null,
               usage: null, ended: false};
  state.controller = new AbortController();
  setRunning(true);
  setStatus("waiting for the server…", "running");
  updateSummary(run);
  try {
    const response = await fetch(chat ? "v1/chat/completions" : "v1/completions", {
      method: "POST", body: JSON.stringify(body), signal: state.controller.signal,
      headers: {"Content-Type": "application/json", ...authHeaders()},
    });
    if (!response.ok) {
      if (response.status === 401) $("key-row").hidden = false;
      throw new ServerError(await errorMessage(response));
    }
    setStatus("generating…", "running");
    let finish = null;
    let complete = false;
    for await (const data of sseData(response)) {
      if (data === "[DONE]") {
        complete = true;
        break;
      }
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ServerError(`the request failed on the server: ${chunk.error.message}`);
      if (chunk.usage) run.usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        if (choice.index !== 0) continue;
        const text = chat ? (choice.delta && choice.delta.content) || "" : choice.text;
        const depths = choice.token_depths || null;
        const added = addTokens(reply, text, depths, chunkLogprobs(choice.logprobs));
        if (added) {
          const now = performance.now();
          if (run.first === null) run.first = now;
          else run.afterFirst += added;
          run.last = now;
        }
        run.tokens += added;
        run.text += text;
        if (depths) run.depths.push(...depths);
        finish = choice.finish_reason || finish;
      }
      if (run.usage) run.tokens = run.usage.completion_tokens;
      updateSummary(run);
    }
    if (!complete) throw new ServerError("the stream ended before the server finished it (connection lost?)");
    setStatus(`done (${finish || "no finish reason"})`, "done");
    if (chat) state.history.push({role: "user", content: prompt}, {role: "assistant", content: run.text});
  } catch (err) {
    if (err.name === "AbortError") {
      setStatus("stopped: the request was aborted on the server", "stopped");
      if (chat) state.history.push({role: "user", content: prompt}, {role: "assistant", content: run.text});
    } else {
      showError(err instanceof ServerError ? err.message : `the request failed: ${err.message}`);
      setStatus("error", "error");
      if (!run.tokens) reply.remove();
    }
  } finally {
    run.ended = true;
    updateSummary(run);
    state.controller = null;
    setRunning(false);
  }
}

function setRunning(running) {
  $("generate").disabled = running;
  $("stop").disabled = !running;
  $("output").setAttribute("aria-busy", String(running));
}

function clearOutput() {
  state.history = [];
  $("output").replaceChildren();
  $("summary").textContent = "";
  hideError();
  setStatus("", "idle");
}

// ---- the token tooltip ------------------------------------------------------------------------------
function showTip(span) {
  const {text, depths, logprobs} = state.info.get(span);
  const tip = $("tip");
  const heading = text ? visible(text) : `${span.dataset.label}: a token with no text (such as the end of sequence)`;
  const lines = [el("div", {className: "tip-token", textContent: heading})];
  if (depths && depths.length) {
    const of = state.legend ? ` of ${state.legend.lo}–${state.legend.hi}` : "";
    const label = depths.length === 1 ? `depth ${depths[0]}${of}` : `depths ${depths.join(", ")}${of} (${depths.length} tokens)`;
    lines.push(el("div", {textContent: label}));
  } else {
    lines.push(el("div", {textContent: "no per-token depth reported"}));
  }
  for (const lp of logprobs || []) {
    if (lp.logprob === null || lp.logprob === undefined) continue;
    const head = logprobs.length > 1 ? `${visible(lp.token)}: ` : "";
    lines.push(el("div", {textContent: `${head}logprob ${fmt(lp.logprob, 3)} (p ${fmt(100 * Math.exp(lp.logprob), 1)}%)`}));
    if (lp.top.length) {
      const list = el("ol", {className: "tip-top"});
      for (const [token, value] of lp.top) list.append(el("li", {textContent: `${visible(token)} ${fmt(value, 3)}`}));
      lines.push(el("div", {textContent: "top alternatives:"}), list);
    }
  }
  tip.replaceChildren(...lines);
  tip.hidden = false;
  const box = span.getBoundingClientRect();
  const left = Math.min(box.left, window.innerWidth - tip.offsetWidth - 8);
  tip.style.left = `${Math.max(8, left) + window.scrollX}px`;
  tip.style.top = `${box.bottom + 6 + window.scrollY}px`;
}

// ---- the metrics panel ------------------------------------------------------------------------------
const POLICIES = {
  fixed: "fixed: every token runs the deepest level its request allows",
  slo: "slo: the deepest level that keeps each step within the time-per-token target",
  confidence: "confidence: each token stops at the first level whose prediction is sure enough",
};

/** The depth policy and the level it currently lets tokens of depth ranges reach (0: not set yet). */
function policyText(policy, target) {
  const cap = target ? `tokens of a depth range now run at most ${target} levels` : "no token of a depth range has run yet";
  return `${POLICIES[policy] || policy}; ${cap}`;
}

/** Samples of the Prometheus text format: [{name, labels, value}]. */
function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    const match = line.match(/^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/);
    if (!match) continue;  // comments and blank lines
    const labels = {};
    for (const [, key, value] of (match[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[key] = value;
    samples.push({name: match[1], labels, value: Number(match[3])});
  }
  return samples;
}

async function pollMetrics() {
  try {
    const response = await fetch("metrics");
    if (!response.ok) throw new Error(await errorMessage(response));
    const samples = parseMetrics(await response.text());
    const total = (name) => samples.filter((s) => s.name === name).reduce((sum, s) => sum + s.value, 0);
    $("m-running").textContent = total("depthserve_requests_running");
    $("m-waiting").textContent = total("depthserve_requests_waiting");
    const used = total("depthserve_kv_pages_used");
    const pages = total("depthserve_kv_pages_total");
    $("m-kv").textContent = `${used} / ${pages} pages (${fmt(pages ? 100 * used / pages : 0, 1)}%)`;
    $("m-kv-meter").value = pages ? used / pages : 0;
    const target = samples.find((s) => s.name === "depthserve_depth_policy_target");
    $("m-target").textContent = target ? policyText(target.labels.policy, target.value) : "–";
    $("m-shed").textContent = total("depthserve_depth_shed_tokens_total");
    $("m-note").textContent = `Polled from /metrics every second; last at ${new Date().toLocaleTimeString()}.`;
  } catch (err) {
    $("m-note").textContent = `/metrics is unavailable: ${err.message}`;
  }
  setTimeout(pollMetrics, METRICS_EVERY_MS);
}

// ---- wiring ------------------------------------------------------------------------------------------
function init() {
  $("model").addEventListener("change", () => { renderModes(); renderKnobs(); });
  $("connect").addEventListener("click", loadModels);
  $("api-key").addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); loadModels(); } });
  $("generate").addEventListener("click", generate);
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("clear").addEventListener("click", clearOutput);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) generate();
  });
  for (const radio of document.querySelectorAll("input[name=mode]")) {
    radio.addEventListener("change", () => {
      $("prompt-label").textContent = radio.value === "chat" ? "Message" : "Prompt";
      clearOutput();
    });
  }
  $("output").addEventListener("mouseover", (e) => { if (e.target.classList.contains("tok")) showTip(e.target); });
  $("output").addEventListener("mouseout", (e) => { if (e.target.classList.contains("tok")) $("tip").hidden = true; });
  $("settings").addEventListener("submit", (e) => e.preventDefault());
  setStatus("", "idle");
  loadModels();
  pollMetrics();
}

init();

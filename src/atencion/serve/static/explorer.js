// atencion attention explorer: translate a sentence with POST /translate, then draw the attention
// the server returns (encoder self-attention, decoder masked self-attention, cross-attention) as a
// layers × heads grid of small heatmaps, one head enlarged with its tokens, and the word alignment
// implied by the mean cross-attention. A GPT's or a BERT's self-attention over the text comes from
// POST /attention and is drawn the same way (a GPT's, with "induction heads" ticked, with each head's
// prefix-matching and copying scores under its heatmap). For a ViT, an image file uploaded to POST /classify
// (multipart, attention=true) comes back with its label and its [CLS] attention rollout, drawn
// over the patch grid on the image. Plain ES2020, no libraries: the page must work offline.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const KEY = new URLSearchParams(location.search).get("key"); // server started with --api-key
const SPECIALS = new Set(["<s>", "</s>"]);

const state = {
  info: null,        // GET /info
  result: null,      // the first translation of the last answer (text, score, nbest, attention)
  layer: null,       // the enlarged head: layer index and head index, or "mean" for the head average
  head: null,
};

// ---------------------------------------------------------------------------------------------
// talking to the server

// GET (no body) or POST (a JSON body, or a FormData as a multipart form) a path relative to the
// page; resolves to the JSON answer, rejects with an Error whose message is the server's {"error": ...} text.
async function api(path, body) {
  const headers = { Accept: "application/json" };
  if (KEY) headers["X-API-Key"] = KEY;
  const options = { method: body === undefined ? "GET" : "POST", headers };
  if (body instanceof FormData) {
    options.body = body;  // the browser sets the multipart Content-Type with its boundary
  } else if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, options);
  } catch (err) {
    throw new Error(`cannot reach the server (${err.message})`);
  }
  let data = null;
  try {
    data = await response.json();
  } catch (err) {
    data = null;
  }
  if (!response.ok) {
    throw new Error(data && data.error ? data.error : `${path}: HTTP ${response.status}`);
  }
  return data;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

function model() {
  const name = $("model").value;
  return state.info.models.find((m) => m.name === name) || state.info.models[0];
}

async function init() {
  try {
    state.info = await api("info");
  } catch (err) {
    showError(err.message);
    return;
  }
  const select = $("model");
  for (const m of state.info.models) {
    select.add(new Option(`${m.name} (${m.task})`, m.name, false, m.name === state.info.default_model));
  }
  // The selector only when there is a choice; the model's name and size are shown in any case.
  select.hidden = $("model-label").hidden = state.info.models.length < 2;
  select.addEventListener("change", describeModel);
  describeModel();
  $("form").addEventListener("submit", (event) => {
    event.preventDefault(); // Enter in any field submits the form
    translate();
  });
  $("upload").addEventListener("click", classifyImage);
  $("kind").addEventListener("change", renderAttention);
  $("units").addEventListener("change", renderAttention);
  $("sentence").focus();
}

function describeModel() {
  const m = model();
  const c = m.config || {};
  const name = state.info.models.length < 2 ? `model ${m.name}: ` : "";
  $("model-info").textContent = `${name}${m.arch}, ${c.n_layers} layers, ${c.n_heads} heads, ` +
    `${(m.parameters / 1e6).toFixed(2)} M parameters`;
  // The page explores translations, and a GPT's or a BERT's self-attention (/attention); another
  // kind of model is named with its endpoints instead.
  const translator = m.task === "translate";
  const images = Boolean(c.inputs && c.inputs.kind === "patches");  // a ViT: an uploaded image's rollout
  $("upload-panel").hidden = !images;
  const explores = translator || m.endpoints.includes("/attention") || images;
  $("translate").disabled = !explores || images;
  $("translate").textContent = translator ? "Translate" : "Show attention";
  $("beam").disabled = $("nbest-size").disabled = !translator;
  $("induction-label").hidden = m.arch !== "decoder";  // a GPT's heads can be scored as induction heads
  showError(explores ? "" : `${m.name} is a model of task ${m.task}: this page explores translators, ` +
    `GPTs and BERTs; ask it through ${m.endpoints.join(", ")} (see /info)`);
  if (translator) $("beam").value = m.decoding.beam;
  $("output-title").textContent = translator ? "Translation" : "Text";
}

// A GPT's or a BERT's self-attention over the sentence: the text is the result, without an n-best list.
// One request to the server, its answer drawn: `doing` while it runs, then the model and the time.
async function ask(doing, endpoint, body, toResult) {
  showError("");
  $("translate").disabled = true;
  $("status").textContent = doing;
  const began = performance.now();
  try {
    const answer = await api(endpoint, body);
    state.result = toResult(answer);
    $("status").textContent = `${answer.model}: ${Math.round(performance.now() - began)} ms`;
    renderResult();
  } catch (err) {
    $("status").textContent = "";
    showError(err.message);
  } finally {
    $("translate").disabled = false;
  }
}

async function translate() {
  const m = model();
  if (m.task !== "translate") {  // a GPT or a BERT: its self-attention over the text
    if (m.endpoints.includes("/attention")) {
      const body = { text: $("sentence").value, model: m.name };
      if (m.arch === "decoder" && $("induction").checked) body.induction = true;
      await ask("reading…", "attention", body, answer => ({
        text: answer.text + answer.generated, nbest: [], attention: answer.attention, induction: answer.induction }));
    }
    return;
  }
  const beam = Number.parseInt($("beam").value, 10);
  const nbest = Number.parseInt($("nbest-size").value, 10);
  // Invalid numbers go to the server as they are: its message says what is wrong.
  const body = {
    sentences: [$("sentence").value], model: m.name,
    beam: Number.isNaN(beam) ? $("beam").value : beam,
    nbest: Number.isNaN(nbest) ? $("nbest-size").value : nbest,
    attention: true,
  };
  await ask("translating…", "translate", body, answer => answer.translations[0]);
}

// An image file to POST /classify with attention=true; its label, and its rollout over the image.
async function classifyImage() {
  const file = $("upload-file").files[0];
  showError("");
  if (!file) {
    showError("choose an image file (PNG or NPY) first");
    return;
  }
  const form = new FormData();
  form.append("file", file);
  form.append("model", model().name);
  form.append("attention", "true");
  $("upload").disabled = true;
  $("upload-status").textContent = "classifying…";
  try {
    const answer = await api("classify", form);
    const best = answer.predictions[0];
    $("upload-label").textContent = `${best.label} (${(100 * best.probability).toFixed(1)}%)`;
    $("upload-status").textContent = answer.model;
    await renderRollout(file, answer.attention);
  } catch (err) {
    $("upload-status").textContent = "";
    showError(err.message);
  } finally {
    $("upload").disabled = false;
  }
}

// The rollout's [CLS] row without [CLS] (the patches, row-major over the grid) as cells over the
// picture (a PNG; an NPY array is not drawn, its cells alone are), each on the min–max scale.
async function renderRollout(file, attention) {
  const [rows, cols] = attention.grid;
  const cells = attention.rollout.slice(1);
  const low = Math.min(...cells);
  const span = Math.max(...cells) - low || 1;
  const size = 256;
  const canvas = document.createElement("canvas");
  canvas.width = canvas.height = size;
  canvas.id = "rollout-canvas";
  const context = canvas.getContext("2d");
  let alpha = 1;
  if (!file.name.toLowerCase().endsWith(".npy")) {
    try {
      const picture = await createImageBitmap(file);
      context.imageSmoothingEnabled = false;
      context.drawImage(picture, 0, 0, size, size);
      alpha = 0.6;
    } catch (err) {
      alpha = 1;  // the server read it; the browser cannot draw it: the cells alone
    }
  }
  cells.forEach((w, k) => {
    const [r, g, b] = colour((w - low) / span);
    context.fillStyle = `rgba(${r}, ${g}, ${b}, ${alpha})`;
    context.fillRect((k % cols) * size / cols, Math.floor(k / cols) * size / rows, size / cols, size / rows);
  });
  canvas.dataset.cells = JSON.stringify(cells);
  $("rollout").replaceChildren(canvas);
}

// ---------------------------------------------------------------------------------------------
// the translation and its n-best list

function renderResult() {
  const r = state.result;
  $("result").hidden = false;
  $("translation").textContent = r.text;
  $("translation").dataset.score = r.score;
  const list = $("nbest");
  list.replaceChildren();
  for (const hyp of r.nbest || []) {
    const item = document.createElement("li");
    const text = document.createElement("span");
    text.className = "hyp";
    text.textContent = hyp.text;
    const score = document.createElement("span");
    score.className = "score";
    score.textContent = hyp.score.toFixed(4);
    score.title = "log-probability score of the beam search";
    item.append(text, score);
    list.append(item);
  }
  const attention = r.attention;
  $("attention").hidden = !attention;
  $("alignment-panel").hidden = !(attention && attention.words && attention.words.cross);
  if (!attention) return;
  // the kinds this model has (a BERT: encoder self-attention; a GPT: masked self-attention)
  for (const option of $("kind").options) option.disabled = !attention.pieces[option.value];
  if (!attention.pieces[$("kind").value]) $("kind").value = Object.keys(attention.pieces)[0];
  const layers = attention.pieces[$("kind").value].weights.length;
  state.layer = layers - 1; // start with the last layer's first head
  state.head = 0;
  renderAttention();
  renderAlignment();
}

// ---------------------------------------------------------------------------------------------
// heatmaps

// Weight in [0, 1] → a colour from white to deep blue (weights above 1 are clipped).
function colour(w) {
  const t = Math.max(0, Math.min(1, w));
  const mix = (a, b) => Math.round(a + (b - a) * t);
  return [mix(255, 8), mix(255, 48), mix(255, 107)];
}

// The head average of one layer: weights[layer] is [head][row][col].
function meanOfHeads(heads) {
  return heads[0].map((row, i) => row.map((_, j) => heads.reduce((sum, h) => sum + h[i][j], 0) / heads.length));
}

function currentMap() {
  return state.result.attention[$("units").value][$("kind").value];
}

function matrixOf(map, layer, head) {
  return head === "mean" ? meanOfHeads(map.weights[layer]) : map.weights[layer][head];
}

// One matrix drawn one pixel per weight on a canvas; CSS scales it up (image-rendering: pixelated).
function smallHeatmap(matrix, size) {
  const rows = matrix.length;
  const cols = matrix[0].length;
  const canvas = document.createElement("canvas");
  canvas.width = cols;
  canvas.height = rows;
  const context = canvas.getContext("2d");
  const image = context.createImageData(cols, rows);
  matrix.forEach((row, i) => row.forEach((w, j) => {
    const [r, g, b] = colour(w);
    image.data.set([r, g, b, 255], 4 * (i * cols + j));
  }));
  context.putImageData(image, 0, 0);
  const scale = size / Math.max(rows, cols);
  canvas.style.width = `${cols * scale}px`;
  canvas.style.height = `${rows * scale}px`;
  return canvas;
}

function renderAttention() {
  if (!state.result || !state.result.attention) return;
  const map = currentMap();
  if (state.layer >= map.weights.length) state.layer = map.weights.length - 1;
  renderGrid(map);
  renderEnlarged(map);
}

// The layers × heads grid (plus a column with each layer's head average); a click enlarges a head.
function renderGrid(map) {
  const grid = $("grid");
  // a GPT's induction scores (POST /attention with induction: true), drawn with its masked self-attention
  const induction = $("kind").value === "decoder" ? state.result.induction : undefined;
  $("induction-note").hidden = !induction;
  grid.dataset.rows = JSON.stringify(map.rows);
  grid.dataset.cols = JSON.stringify(map.cols);
  const table = document.createElement("table");
  const caption = table.createCaption();
  caption.textContent = `${$("kind").selectedOptions[0].text} · ${$("units").value} · ` +
    `${map.rows.length} queries × ${map.cols.length} keys`;
  const heads = map.weights[0].length;
  const header = table.createTHead().insertRow();
  header.append(document.createElement("th"));
  for (let h = 0; h < heads; h++) header.append(cellHeader(`head ${h + 1}`));
  header.append(cellHeader("mean"));
  const body = table.createTBody();
  map.weights.forEach((layerWeights, layer) => {
    const row = body.insertRow();
    const label = cellHeader(`layer ${layer + 1}`);
    label.scope = "row";
    row.append(label);
    for (const head of [...layerWeights.keys(), "mean"]) {
      const cell = row.insertCell();
      cell.className = "head";
      cell.dataset.layer = layer;
      cell.dataset.head = head;
      cell.tabIndex = 0;
      const name = head === "mean" ? `layer ${layer + 1}, mean of ${heads} heads` : `layer ${layer + 1}, head ${head + 1}`;
      cell.title = `${name}: click to enlarge`;
      cell.setAttribute("role", "button");
      cell.setAttribute("aria-label", name);
      if (layer === state.layer && String(head) === String(state.head)) cell.classList.add("selected");
      cell.append(smallHeatmap(matrixOf(map, layer, head), 72));
      if (induction && head !== "mean") {
        const p = induction.prefix_matching[layer][head], c = induction.copying[layer][head];
        const scores = document.createElement("div");
        scores.className = "scores";
        scores.textContent = `P ${p.toFixed(2)} · C ${c.toFixed(2)}`;
        cell.append(scores);
        cell.title = `${name}: prefix matching ${p}, copying ${c}; click to enlarge`;
        if (induction.induction_heads.some(([l, h]) => l === layer && h === head)) cell.classList.add("induction");
      }
    }
  });
  grid.replaceChildren(table);
}

function cellHeader(text) {
  const th = document.createElement("th");
  th.textContent = text;
  return th;
}

// A click (or Enter / space on a focused cell) on the grid selects that head.
function onGridPick(event) {
  if (event.type === "keydown" && event.key !== "Enter" && event.key !== " ") return;
  const cell = event.target.closest("td.head");
  if (!cell) return;
  event.preventDefault();
  state.layer = Number(cell.dataset.layer);
  state.head = cell.dataset.head === "mean" ? "mean" : Number(cell.dataset.head);
  for (const other of $("grid").querySelectorAll("td.selected")) other.classList.remove("selected");
  cell.classList.add("selected");
  renderEnlarged(currentMap());
}

// The selected head as a table: queries as rows, keys as columns, the weight in each cell
// (data-weight holds the exact number from the API; hover shows "query → key: weight").
function renderEnlarged(map) {
  const matrix = matrixOf(map, state.layer, state.head);
  const box = $("enlarged");
  const title = document.createElement("h3");
  const which = state.head === "mean" ? `mean of ${map.weights[0].length} heads` : `head ${state.head + 1}`;
  title.textContent = `${$("kind").selectedOptions[0].text} · layer ${state.layer + 1} · ${which}`;
  box.dataset.layer = state.layer;
  box.dataset.head = state.head;
  const table = document.createElement("table");
  table.className = "heatmap";
  const numbers = map.cols.length <= 16; // print the weights in the cells while they fit
  const header = table.createTHead().insertRow();
  const corner = cellHeader("query ↓  key →");
  corner.className = "corner";
  header.append(corner);
  for (const token of map.cols) {
    const th = cellHeader(token);
    th.className = "col-label";
    th.scope = "col";
    header.append(th);
  }
  const body = table.createTBody();
  matrix.forEach((weights, i) => {
    const row = body.insertRow();
    const th = cellHeader(map.rows[i]);
    th.className = "row-label";
    th.scope = "row";
    row.append(th);
    weights.forEach((w, j) => {
      const td = row.insertCell();
      const [r, g, b] = colour(w);
      td.style.background = `rgb(${r}, ${g}, ${b})`;
      if (w > 0.5) td.classList.add("dark");
      td.dataset.weight = String(w);
      td.dataset.row = i;
      td.dataset.col = j;
      td.title = `${map.rows[i]} → ${map.cols[j]}: ${w.toFixed(4)}`;
      if (numbers) td.textContent = w.toFixed(2);
    });
  });
  const hover = document.createElement("p");
  hover.id = "hover";
  hover.className = "hover";
  hover.textContent = "hover a cell: query → key: weight";
  table.addEventListener("mouseover", (event) => {
    const td = event.target.closest("td");
    if (td) hover.textContent = td.title;
  });
  box.replaceChildren(title, table, hover);
}

// ---------------------------------------------------------------------------------------------
// the alignment: source words above, target words below, lines between them

const FONT = "20px system-ui, sans-serif";

function textWidth(text) {
  const context = (textWidth.canvas ||= document.createElement("canvas")).getContext("2d");
  context.font = FONT;
  return context.measureText(text).width;
}

// x centres of the words laid out in a row starting at `left`, and the row's width.
function layout(words, left) {
  const gap = 28;
  const centres = [];
  let x = left;
  for (const word of words) {
    const width = Math.max(textWidth(word), 16);
    centres.push(x + width / 2);
    x += width + gap;
  }
  return { centres, width: x - left - gap };
}

function svg(name, attributes, parent) {
  const element = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, value);
  if (parent) parent.append(element);
  return element;
}

function renderAlignment() {
  const box = $("alignment");
  const attention = state.result.attention;
  const cross = attention.words && attention.words.cross;
  if (!cross) {
    box.replaceChildren();
    return;
  }
  // Real words only (no <s>, </s>): the API's alignment indices count these.
  const srcIndex = cross.cols.map((w, j) => j).filter((j) => !SPECIALS.has(cross.cols[j]));
  const tgtIndex = cross.rows.map((w, i) => i).filter((i) => !SPECIALS.has(cross.rows[i]));
  const source = srcIndex.map((j) => cross.cols[j]);
  const target = tgtIndex.map((i) => cross.rows[i]);
  // Mean over every layer and head, as the server does before taking the argmax.
  const layers = cross.weights.map(meanOfHeads);
  const mean = layers[0].map((row, i) => row.map((_, j) => layers.reduce((s, l) => s + l[i][j], 0) / layers.length));

  const margin = 90; // room for the row names on the left
  const src = layout(source, margin);
  const tgt = layout(target, margin);
  const width = margin + Math.max(src.width, tgt.width) + 20;
  // Centre the shorter row under (or over) the longer one.
  const shift = (row) => (Math.max(src.width, tgt.width) - row.width) / 2;
  const xs = src.centres.map((x) => x + shift(src));
  const xt = tgt.centres.map((x) => x + shift(tgt));
  const ySrc = 30;
  const yTgt = 170;
  const root = svg("svg", { width, height: 190, viewBox: `0 0 ${width} 190`, role: "img",
    "aria-label": "word alignment between the source and the target sentence" });

  svg("text", { x: 8, y: ySrc, class: "row-name" }, root).textContent = "source";
  svg("text", { x: 8, y: yTgt, class: "row-name" }, root).textContent = "target";
  // Grey lines: the mean cross-attention of every target word to every source word.
  const weights = svg("g", { class: "weights" }, root);
  tgtIndex.forEach((i, t) => srcIndex.forEach((j, s) => {
    const w = mean[i][j];
    if (w < 0.02) return;
    svg("line", { x1: xs[s], y1: ySrc + 10, x2: xt[t], y2: yTgt - 24, class: "weight",
      "stroke-opacity": Math.min(1, w).toFixed(3), "stroke-width": (1 + 5 * w).toFixed(2) }, weights);
  }));
  // Coloured lines: the alignment the API computed ([source word, target word] pairs).
  const links = svg("g", { class: "links" }, root);
  for (const [s, t] of attention.alignment || []) {
    const line = svg("line", { x1: xs[s], y1: ySrc + 10, x2: xt[t], y2: yTgt - 24, class: "link" }, links);
    Object.assign(line.dataset, { src: s, tgt: t, srcWord: source[s], tgtWord: target[t] });
    svg("title", {}, line).textContent = `${source[s]} ↔ ${target[t]} (mean weight ${mean[tgtIndex[t]][srcIndex[s]].toFixed(4)})`;
  }
  const words = (list, xsOf, y, side) => list.forEach((word, k) => {
    const text = svg("text", { x: xsOf[k], y, class: `word ${side}`, "text-anchor": "middle" }, root);
    text.dataset.index = k;
    text.textContent = word;
  });
  words(source, xs, ySrc, "src");
  words(target, xt, yTgt, "tgt");
  // Hovering a word highlights its links.
  root.addEventListener("mouseover", (event) => highlight(root, event.target));
  root.addEventListener("mouseout", () => highlight(root, null));
  box.replaceChildren(root);
}

function highlight(root, target) {
  const word = target && target.classList && target.classList.contains("word") ? target : null;
  root.classList.toggle("focus", Boolean(word));
  for (const line of root.querySelectorAll("line.link")) {
    const on = word && (word.classList.contains("src") ? line.dataset.src : line.dataset.tgt) === word.dataset.index;
    line.classList.toggle("on", Boolean(on));
  }
}

// ---------------------------------------------------------------------------------------------

$("grid").addEventListener("click", onGridPick);
$("grid").addEventListener("keydown", onGridPick);
if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
else init();

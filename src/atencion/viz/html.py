"""One self-contained HTML page to explore every head and layer: no server, no network.

The weights are inlined as JSON and about a hundred lines of plain JavaScript draw a heatmap
table: choose the kind (encoder, decoder, cross; a GPT or a BERT has its one self-attention),
the layer (or the mean of all layers) and the head (or the mean of all heads); hovering a cell
shows its query, key and weight.
"""

from __future__ import annotations

import html
import json

from .attention import CAUTION, Attention, SelfAttention, kind_note

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
.note { color: #666; font-size: 90%; max-width: 60em; }
#controls { margin: 1em 0; } #controls label { margin-right: 1.2em; }
#info { font-family: monospace; min-height: 1.4em; margin: .5em 0; }
table { border-collapse: collapse; font-size: 12px; }
th { font-weight: normal; white-space: nowrap; padding: 0 .4em; }
th.key { writing-mode: vertical-rl; transform: rotate(180deg); padding: .4em 0; }
td { width: 2.2em; height: 1.7em; border: 1px solid #f4f4f4; text-align: center; font-size: 9px; }
"""

SCRIPT = """
const $ = (id) => document.getElementById(id);

function fill(select, options) {
  const previous = select.value;
  select.replaceChildren();
  for (const [value, text] of options) {
    const option = document.createElement("option");
    option.value = value;
    option.textContent = text;
    select.appendChild(option);
  }
  if (options.some(([value]) => String(value) === previous)) select.value = previous;
}

function setup() {
  const map = DATA.maps[$("kind").value];
  const layers = map.weights.length, heads = map.weights[0].length;
  const range = (n, word) => Array.from({length: n}, (_, i) => [String(i), word + " " + (i + 1)]);
  fill($("layer"), [["mean", "mean of layers"], ...range(layers, "layer")]);
  fill($("head"), [["mean", "mean of heads"], ...range(heads, "head")]);
  draw();
}

// The mean over the chosen layers and heads of a (layers, heads, queries, keys) array.
function matrix(map, layer, head) {
  const layers = layer === "mean" ? map.weights.map((_, l) => l) : [Number(layer)];
  const heads = head === "mean" ? map.weights[0].map((_, h) => h) : [Number(head)];
  const out = map.rows.map(() => map.cols.map(() => 0));
  const n = layers.length * heads.length;
  for (const l of layers)
    for (const h of heads)
      map.weights[l][h].forEach((row, i) => row.forEach((w, j) => { out[i][j] += w / n; }));
  return out;
}

function cell(tag, text, className) {
  const element = document.createElement(tag);
  element.textContent = text;
  if (className) element.className = className;
  return element;
}

function draw() {
  const kind = $("kind").value, map = DATA.maps[kind];
  const weights = matrix(map, $("layer").value, $("head").value);
  const top = Math.max(1, ...weights.flat());
  const showValues = $("values").checked;
  const table = $("map");
  table.replaceChildren();
  const header = document.createElement("tr");
  header.appendChild(cell("th", "queries \\u2193  keys \\u2192"));
  for (const key of map.cols) header.appendChild(cell("th", key, "key"));
  table.appendChild(header);
  weights.forEach((row, i) => {
    const tr = document.createElement("tr");
    tr.appendChild(cell("th", map.rows[i]));
    row.forEach((w, j) => {
      const td = cell("td", showValues ? w.toFixed(2) : "");
      const shade = Math.round(255 * (1 - w / top));
      td.style.background = `rgb(${shade}, ${shade}, 255)`;
      td.style.color = w / top > 0.5 ? "white" : "black";
      td.title = `${map.rows[i]} \\u2192 ${map.cols[j]}: ${w.toFixed(4)}`;
      td.onmouseenter = () => { $("info").textContent = td.title; };
      tr.appendChild(td);
    });
    table.appendChild(tr);
  });
  $("legend").textContent = DATA.legends[kind];
}

for (const id of ["kind", "layer", "head", "values"]) $(id).onchange = id === "kind" ? setup : draw;
setup();
"""


def _legends(attention: Attention | SelfAttention) -> dict[str, str]:
    legends = _eq1_legends(attention)
    note = kind_note(attention.attention_kind)  # the self-attention maps of another kind: what they show
    if note:
        for kind in ("encoder", "decoder"):
            legends[kind] = f"{legends[kind]}; {note}"
    return legends


def _eq1_legends(attention: Attention | SelfAttention) -> dict[str, str]:
    if isinstance(attention, SelfAttention):
        return {"decoder": "rows and columns: the text's tokens, then any generated ones; causal: no key after its "
                           "query; each row sums to 1",
                "encoder": "rows and columns: <s> + the sentence's pieces + </s>; bidirectional: every query sees "
                           "every key; each row sums to 1"}
    cross_rows = ("each row is labelled with the target token its output predicts" if attention.shift == "predict"
                  else "each row is labelled with the target token the decoder reads there")
    return {"encoder": "rows: source queries; columns: source keys; each row sums to 1",
            "decoder": "rows and columns: the decoder's inputs (<s> + target); masked: no key after its query",
            "cross": f"rows: target ({cross_rows}, shift '{attention.shift}'); columns: source"}


def _heading(attention: Attention | SelfAttention) -> tuple[str, str]:
    """The page's title and the HTML of the line that says what the maps are of."""
    pieces = "subword pieces" if isinstance(attention, Attention) else "tokens"
    unit = "words" if any(amap.words for amap in attention.maps().values()) else pieces
    if isinstance(attention, Attention):
        return attention.src, (f"source: <b>{html.escape(attention.src)}</b><br>"
                               f"target: <b>{html.escape(attention.tgt)}</b> ({unit})")
    if attention.self_attention.kind == "encoder":
        return attention.text, f"sentence: <b>{html.escape(attention.text)}</b> ({unit})"
    generated = f"<br>generated (greedy): <b>{html.escape(attention.generated)}</b>" if attention.generated else ""
    return attention.text, f"text: <b>{html.escape(attention.text)}</b>{generated} ({unit})"


def attention_html(attention: Attention | SelfAttention, digits: int = 4) -> str:
    """The page for ``attention`` (piece- or word-level maps, as given), as a string."""
    maps = {kind: {"rows": amap.rows, "cols": amap.cols, "weights": amap.weights.round(digits).tolist()}
            for kind, amap in attention.maps().items()}
    data = {"maps": maps, "legends": _legends(attention)}
    # "</" would end the <script> element early; "<\\/" is the same string to JSON.
    payload = json.dumps(data, ensure_ascii=False).replace("</", "<\\/")
    title, heading = _heading(attention)
    options = "".join(f'<option value="{kind}">{kind}</option>' for kind in maps)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>attention: {html.escape(title)}</title>
<style>{STYLE}</style>
</head>
<body>
<h1>Attention weights</h1>
<p>{heading}</p>
<p class="note">Caution: {html.escape(CAUTION)}.</p>
<div id="controls">
<label>kind <select id="kind">{options}</select></label>
<label><select id="layer"></select></label>
<label><select id="head"></select></label>
<label><input type="checkbox" id="values"> show values</label>
</div>
<p class="note" id="legend"></p>
<div id="info"></div>
<table id="map"></table>
<script>
const DATA = {payload};
{SCRIPT}
</script>
</body>
</html>
"""

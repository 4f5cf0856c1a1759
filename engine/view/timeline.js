// The timeline of one run: a lane per agent, bars on one time axis, a panel for the selected bar.

const LABEL = 180, ROW = 22, PAD = 4;
const MARKS = {interrupted: "‖", killed: "✕", died: "✝"};
const WORDS = {ok: "done", error: "error", interrupted: "interrupted", killed: "killed", died: "died",
               cancelled: "cancelled (its run ended)"};

function laneOrder(lanes) {
  // Parents before their sub-agents, siblings in the order they started.
  const children = new Map();
  lanes.forEach((lane, i) => {
    const key = lane.parent === null || lane.parent === undefined ? -1 : lane.parent;
    if (!children.has(key)) children.set(key, []);
    children.get(key).push(i);
  });
  const order = [];
  const walk = (key) => (children.get(key) || []).forEach((i) => { order.push(i); walk(i); });
  walk(-1);
  lanes.forEach((_, i) => { if (!order.includes(i)) order.push(i); });
  return order;
}

function pack(items) {
  // Requests on the lane's first row; blocks and tool calls packed below, one row per overlap,
  // so blocks that ran at once sit one above the other.
  const rows = [];
  for (const item of items.filter((i) => i.k !== "request").sort((a, b) => a.s - b.s)) {
    let row = rows.findIndex((end) => end <= item.s);
    if (row < 0) { row = rows.length; rows.push(0); }
    rows[row] = item.e ?? Infinity;
    item.row = row + 1;
  }
  items.filter((i) => i.k === "request").forEach((i) => { i.row = 0; });
  return rows.length + 1;
}

function axisStep(total) {
  const steps = [0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600];
  return steps.find((s) => total / s <= 12) || 43200;
}

function describe(item) {
  if (item.k === "request") return `model request${item.model ? " to " + item.model : ""}`;
  if (item.k === "tool") return `tool call ${item.tool || ""}`;
  return `block ${item.id}`;
}

function textBlock(title, text) {
  return text ? [el("h4", {}, title), el("pre", {}, text)] : [];
}

function shownItem(shown) {
  // A display: images only as img elements of data the page holds (an SVG too: an image never runs
  // its scripts), HTML only as text.
  const figure = el("figure", {class: "shown", "data-index": shown.index});
  if (shown.png) figure.append(el("img", {src: "data:image/png;base64," + shown.png, alt: shown.line || "image",
                                          "data-kind": "png"}));
  if (shown.svg) figure.append(el("img", {src: "data:image/svg+xml;base64," + shown.svg, alt: shown.line || "SVG image",
                                          "data-kind": "svg"}));
  if (shown.omitted) figure.append(el("p", {class: "cut"}, `[an image of ${count(shown.omitted)} bytes is not in this page: the page's images reached their size limit]`));
  if (shown.html) figure.append(el("h5", {}, "HTML (as text)"), el("pre", {class: "html"}, shown.html));
  if (!shown.png && !shown.svg && shown.text) figure.append(el("pre", {}, shown.text));
  if (shown.line) figure.append(el("figcaption", {}, shown.line));
  return figure;
}

function showDetail(panel, item, lanes) {
  panel.replaceChildren();
  const lane = lanes[item.lane] || {name: "?"};
  const rows = [["agent", lane.name], ["started", `+${seconds(item.s)}`], ["took", item.e === null || item.e === undefined ? "unfinished" : seconds(item.e - item.s)]];
  if (item.k === "block") {
    rows.push(["ended", WORDS[item.o] || item.o], ["status", item.status || "–"], ["timeout", item.timeout ? seconds(item.timeout) : "–"],
              ["output", item.bytes === null || item.bytes === undefined ? "–" : `${count(item.bytes)} bytes`],
              ["heartbeats", String((item.beats || []).length)]);
    if (item.lost && item.lost.length) rows.push(["the kill lost", item.lost.join(", ")]);
    if (item.message) rows.push(["what happened", item.message]);
  } else if (item.k === "request") {
    rows.push(["outcome", item.error ? `failed (${item.error})` : (item.o === "ok" ? "answered" : item.o)],
              ["tokens", `${count(item.tokens_in)} in, ${count(item.tokens_out)} out`],
              ["finish reason", item.finish_reason || "–"], ["attempts", String((item.attempts || []).length)]);
    if (item.ttft !== undefined) rows.push(["first token after", seconds(item.ttft)]);
    if (item.timings) rows.push(["server timings", Object.entries(item.timings).map(([k, v]) => `${k} ${v}`).join(", ")]);
    (item.attempts || []).forEach((a, n) => {
      if (a.o && a.o !== "ok") rows.push([`attempt ${n + 1}`, `${a.o}${a.error ? " (" + a.error + ")" : ""}`]);
    });
  } else {
    rows.push(["tool", item.tool || "–"]);
  }
  panel.append(el("h3", {}, describe(item)),
               el("dl", {class: "grid"}, rows.map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)])));
  if (item.k === "block") {
    panel.append(...textBlock("Code", (item.code || "").replace(/^\n/, "")));
    const out = item.out || {head: "", tail: "", cut: 0};
    if (out.head || out.tail) {
      const pre = el("pre", {class: "output"}, out.head);
      if (out.cut > 0) pre.append(el("span", {class: "cut"}, `\n[… ${count(out.cut)} characters not kept …]\n`));
      pre.append(out.tail);
      panel.append(el("h4", {}, "Output (as it streamed: head and tail)"), pre);
    }
    if (item.shown && item.shown.length) panel.append(el("h4", {}, "Displayed"), ...item.shown.map(shownItem));
    if (item.net && item.net.length) {
      // What its code reached through the sandbox's way out (--allow-net), one row a connection.
      const rows = item.net.map((c) => el("tr", {class: c.verdict === "allowed" ? "" : "refused"},
        el("td", {}, `${c.host}:${c.port}`), el("td", {}, c.verdict + (c.why ? ` (${c.why})` : "")),
        el("td", {}, `${count(c.sent)} B out, ${count(c.received)} B in`)));
      panel.append(el("h4", {}, "Network (--allow-net)"), el("table", {class: "network"}, rows));
      if (item.net_more) panel.append(el("p", {class: "cut"}, `[${count(item.net_more)} more connections not in this page]`));
    }
    panel.append(...textBlock("Result (what the model was sent)", item.result));
  } else if (item.k === "request") {
    panel.append(...textBlock("Sent", item.message), ...textBlock("Reply", item.reply));
  } else {
    panel.append(...textBlock("Arguments", item.args), ...textBlock("Result", item.result));
  }
}

function render() {
  const {totals, lanes, items, notes} = DATA;
  const total = Math.max(totals.duration || 0, ...items.map((i) => i.e || i.s || 0), 0.001);
  const header = el("header", {},
    el("h1", {}, "agentloop run · ", DATA.source),
    el("div", {class: "facts", id: "totals"},
      totals.status ? el("span", {}, pill(totals.status)) : null,
      fact("time", seconds(totals.duration)), fact("agents", count(totals.agents)),
      fact("model requests", count(totals.requests)), fact("blocks", count(totals.blocks)),
      fact("tokens in", count(totals.tokens_in)), fact("tokens out", count(totals.tokens_out)),
      fact("cost", money(totals.cost))),
    DATA.warning ? el("div", {class: "warning", id: "warning", role: "alert"}, "⚠ ", DATA.warning) : null, summarised());

  const chart = el("div", {class: "chart", style: `--label: ${LABEL}px`});
  const axis = el("div", {class: "axis"});
  const step = axisStep(total);
  for (let t = 0; t <= total + 1e-9; t += step) {
    axis.append(el("span", {style: `left: ${(t / total) * 100}%`}, seconds(t)));
  }
  chart.append(axis);
  const panel = el("section", {class: "detail", id: "detail"}, el("p", {class: "cut"}, "Select a bar to see its code, output and result."));
  let selected = null;
  const select = (bar, item) => {
    if (selected) selected.classList.remove("selected");
    selected = bar;
    bar.classList.add("selected");
    showDetail(panel, item, lanes);
  };
  const pct = (t) => `${Math.max(0, Math.min(100, (t / total) * 100))}%`;
  for (const index of laneOrder(lanes)) {
    const lane = lanes[index];
    const own = items.filter((i) => i.lane === index);
    const rows = pack(own);
    const track = el("div", {class: "track", style: `height: ${rows * ROW + PAD * 2}px; background-size: ${100 / (total / step)}% 100%`});
    if (lane.s !== undefined) {
      const end = lane.e === null || lane.e === undefined ? total : lane.e;
      track.append(el("div", {class: "agent-span", style: `left: ${pct(lane.s)}; width: ${pct(end - lane.s)}; top: ${rows * ROW + PAD}px`}));
    }
    for (const item of own) {
      const end = item.e === null || item.e === undefined ? total : item.e;
      const classes = ["bar", item.k, item.o || "open"];
      if (item.e === null || item.e === undefined) classes.push("open");
      const title = `${describe(item)} · ${WORDS[item.o] || item.o || "unfinished"} · ${seconds(end - item.s)}`;
      const bar = el("div", {class: classes.join(" "), role: "button", tabindex: 0, title,
        "data-kind": item.k, "data-id": item.id, "data-outcome": item.o || "open", "data-agent": lane.name,
        style: `left: ${pct(item.s)}; width: ${pct(end - item.s)}; top: ${item.row * ROW + PAD}px`});
      if (item.k === "request") {
        // A failed attempt is hatched up to the next one: its wait before the retry included.
        const attempts = item.attempts || [];
        attempts.forEach((a, n) => {
          if (!a.o || a.o === "ok") return;
          const span = Math.max(end - item.s, 1e-9), until = n + 1 < attempts.length ? attempts[n + 1].s : (a.e ?? end);
          const left = ((a.s - item.s) / span) * 100, width = ((until - a.s) / span) * 100;
          bar.append(el("span", {class: "attempt-failed", "data-attempt": n + 1, style: `left: ${left}%; width: ${width}%`}));
        });
      }
      for (const beat of item.beats || []) {
        const span = Math.max(end - item.s, 1e-9);
        bar.append(el("span", {class: "tick", "data-t": beat, style: `left: ${((beat - item.s) / span) * 100}%`}));
      }
      if (MARKS[item.o]) bar.append(el("span", {class: "mark"}, MARKS[item.o]));
      bar.addEventListener("click", () => select(bar, item));
      bar.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); select(bar, item); } });
      track.append(bar);
    }
    const label = el("div", {class: "label", style: `padding-left: ${8 + lane.depth * 14}px`, title: lane.task || lane.name},
      lane.depth ? (lane.forked ? "⑂ " : "↳ ") : "", lane.name,
      el("small", {}, [lane.model, lane.status || (lane.unfinished ? "unfinished" : null)].filter(Boolean).join(" · ")));
    chart.append(el("div", {class: "lane", "data-agent": lane.name, "data-depth": lane.depth}, label, track));
  }
  const legend = el("div", {class: "legend"},
    [["request", "model request"], ["ok", "block done"], ["error", "block error"], ["interrupted", "interrupted ‖"],
     ["killed", "killed ✕"], ["died", "worker died ✝"], ["cancelled", "cancelled"], ["tool", "tool call"]]
      .map(([k, v]) => el("span", {}, el("i", {style: `background: var(--${k})`}), v)),
    el("span", {}, "ticks: heartbeats; hatched: a failed attempt, or still running when the recording ends"));
  const noteList = notes.length ? [el("h2", {}, "Notes"), el("ul", {class: "notes", id: "notes"},
    notes.map((n) => el("li", {"data-kind": n.kind}, el("span", {class: "when"}, `+${seconds(n.t)}`),
      n.lane === null || n.lane === undefined ? "" : `${lanes[n.lane].name}: `, n.kind === "note" ? "" : `${n.kind}: `, n.text)))] : [];
  const tasks = lanes.filter((l) => l.task).map((l) => [el("h4", {}, `${l.name}'s task`), el("pre", {}, l.task)]);
  APP.replaceChildren(header, el("h2", {}, "Timeline"), chart, legend, panel, ...noteList,
    tasks.length ? el("h2", {}, "Tasks") : null, ...tasks.flat());
}

render();
ready();

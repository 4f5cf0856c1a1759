// The report of a batch (or of code samples): counts, reasons, durations, the slowest and failed runs.

const PAGE = 100;

function statusTable() {
  const counts = DATA.by_status;
  const most = Math.max(1, ...Object.values(counts));
  const order = [...DATA.statuses, ...Object.keys(counts).filter((s) => !DATA.statuses.includes(s))];
  return el("table", {id: "by-status"},
    el("thead", {}, el("tr", {}, el("th", {}, "status"), el("th", {class: "num"}, "runs"), el("th", {class: "num"}, "share"), el("th", {}, ""))),
    el("tbody", {}, order.filter((s) => counts[s] !== undefined).map((s) => el("tr", {"data-status": s},
      el("td", {}, pill(s)), el("td", {class: "num"}, count(counts[s])),
      el("td", {class: "num"}, DATA.runs ? `${((counts[s] / DATA.runs) * 100).toFixed(1)}%` : "–"),
      el("td", {style: "width: 50%"}, el("div", {class: "meter", style: `width: ${(counts[s] / most) * 100}%; background: var(--${/^[a-z_]+$/.test(s) ? s : "cancelled"})`}))))));
}

function reasonTable() {
  if (!DATA.reasons.length) return el("p", {class: "cut", id: "reasons"}, "No run failed.");
  return el("table", {id: "reasons"},
    el("thead", {}, el("tr", {}, el("th", {}, "failure reason"), el("th", {class: "num"}, "runs"))),
    el("tbody", {}, DATA.reasons.slice(0, 50).map(([text, n]) => el("tr", {}, el("td", {class: "error"}, text), el("td", {class: "num"}, count(n))))));
}

function histogram() {
  const {edges, counts, log} = DATA.histogram;
  const box = el("div", {class: "histogram", id: "histogram"});
  if (!edges.length) return box;
  const bins = edges.length - 1;
  const statuses = Object.keys(counts).filter((s) => counts[s].some((n) => n > 0));
  const heights = Array.from({length: bins}, (_, i) => statuses.reduce((sum, s) => sum + counts[s][i], 0));
  const most = Math.max(1, ...heights);
  const W = 1000, H = 200, left = 40, bottom = 20, width = (W - left) / bins;
  const chart = svg("svg", {viewBox: `0 0 ${W} ${H + bottom}`, preserveAspectRatio: "none", role: "img",
                            "aria-label": "histogram of run durations"});
  for (let i = 0; i < bins; i++) {
    let y = H;
    for (const s of statuses) {
      const n = counts[s][i];
      if (!n) continue;
      const h = (n / most) * (H - 10);
      y -= h;
      chart.append(svg("rect", {x: left + i * width + 1, y, width: Math.max(1, width - 2), height: h,
        fill: `var(--${/^[a-z_]+$/.test(s) ? s : "cancelled"})`, "data-bin": i, "data-status": s},
        svg("title", {}, `${n} ${s} runs, ${seconds(edges[i])} to ${seconds(edges[i + 1])}`)));
    }
  }
  chart.append(svg("text", {x: 2, y: 10}, count(most)), svg("text", {x: 2, y: H}, "0"));
  for (let i = 0; i <= bins; i += Math.max(1, Math.floor(bins / 8))) {
    chart.append(svg("text", {x: left + i * width, y: H + 14, "text-anchor": i === bins ? "end" : "middle"}, seconds(edges[i])));
  }
  box.append(chart, el("div", {class: "legend"},
    statuses.map((s) => el("span", {}, el("i", {style: `background: var(--${/^[a-z_]+$/.test(s) ? s : "cancelled"})`}), s)),
    el("span", {}, log ? "durations on a logarithmic scale" : "durations")));
  return box;
}

function runRow(run) {
  const cells = [el("td", {}, run.link ? el("a", {href: run.link}, run.id) : run.id), el("td", {}, pill(run.status)),
                 el("td", {class: "num"}, seconds(run.duration))];
  if (DATA.kind === "batch") {
    cells.push(el("td", {class: "num"}, `${count(run.tokens_in)} / ${count(run.tokens_out)}`),
               el("td", {class: "num"}, money(run.cost)), el("td", {class: "num"}, String(run.attempts ?? "–")),
               el("td", {class: "error"}, run.error || "",
                  run.link ? "" : el("div", {class: "cut"}, run.transcript ? `record: ${run.transcript}` : "")));
  } else {
    const output = (run.stdout || run.stderr) ? el("details", {}, el("summary", {}, "output"),
      run.stdout ? el("pre", {}, run.stdout) : null, run.stderr ? el("pre", {}, run.stderr) : null) : null;
    // (--allow-net) what its code reached, one line a connection
    const network = run.network ? el("details", {class: "network"}, el("summary", {}, `network (${count(run.network_count)})`),
      el("pre", {}, run.network.join("\n") + (run.network_count > run.network.length ? `\n[… ${count(run.network_count - run.network.length)} more]` : ""))) : null;
    cells.push(el("td", {class: "num"}, String(run.exit_code ?? "–")),
               el("td", {class: "num"}, run.max_rss_mb === null || run.max_rss_mb === undefined ? "–" : `${run.max_rss_mb} MB`),
               el("td", {class: "error"}, run.error || "", output, network));
  }
  return el("tr", {"data-id": run.id, "data-status": run.status}, cells);
}

function runTable(id, runs) {
  const head = DATA.kind === "batch" ? ["run", "status", "time", "tokens in / out", "cost", "attempts", "error"]
                                     : ["sample", "status", "time", "exit", "memory", "message"];
  const body = el("tbody", {});
  const table = el("table", {id}, el("thead", {}, el("tr", {}, head.map((h, i) => el("th", {class: i >= 2 && i < head.length - 1 ? "num" : null}, h)))), body);
  const pager = el("div", {class: "pager"});
  let page = 0;
  const pages = Math.max(1, Math.ceil(runs.length / PAGE));
  const show = () => {
    body.replaceChildren(...runs.slice(page * PAGE, page * PAGE + PAGE).map(runRow));
    pager.replaceChildren(
      el("button", {type: "button", disabled: page === 0, onclick: () => { page -= 1; show(); }}, "← previous"),
      el("span", {}, `page ${page + 1} of ${pages} (${count(runs.length)} runs)`),
      el("button", {type: "button", disabled: page >= pages - 1, onclick: () => { page += 1; show(); }}, "next →"));
  };
  show();
  return runs.length > PAGE ? [pager, table] : [table];
}

function render() {
  const t = DATA.totals;
  const what = DATA.kind === "batch" ? "batch" : "code samples";
  const failedShare = DATA.runs ? (DATA.failed_total / DATA.runs) * 100 : 0;
  const cards = el("div", {class: "cards", id: "totals"},
    el("div", {class: "card"}, el("div", {class: "big", id: "runs"}, count(DATA.runs)), el("div", {class: "small"}, "runs")),
    el("div", {class: "card"}, el("div", {class: "big"}, count(DATA.failed_total)), el("div", {class: "small"}, `failed (${failedShare.toFixed(1)}%)`)),
    el("div", {class: "card"}, el("div", {class: "big"}, seconds(t.p50)), el("div", {class: "small"}, `median time; p99 ${seconds(t.p99)}`)),
    DATA.kind === "batch" ? el("div", {class: "card"}, el("div", {class: "big"}, count(t.tokens_in + t.tokens_out)),
      el("div", {class: "small"}, `tokens (${count(t.tokens_in)} in, ${count(t.tokens_out)} out)`)) : null,
    DATA.kind === "batch" ? el("div", {class: "card"}, el("div", {class: "big"}, money(t.cost)), el("div", {class: "small"}, "cost")) : null,
    el("div", {class: "card"}, el("div", {class: "big"}, seconds(t.duration)), el("div", {class: "small"}, "run time, summed")));
  const failedNote = DATA.failed_total > DATA.failed.length ? el("p", {class: "cut"}, `The first ${count(DATA.failed.length)} of them; the rest are in ${DATA.source}.`) : null;
  APP.replaceChildren(
    el("header", {}, el("h1", {}, `agentloop ${what} report · `, DATA.source),
      el("div", {class: "facts"}, fact("runs", count(DATA.runs)), DATA.lines !== DATA.runs ? fact("lines", count(DATA.lines)) : null),
      DATA.warning ? el("div", {class: "warning", id: "warning", role: "alert"}, "⚠ ", DATA.warning) : null, summarised()),
    cards,
    el("h2", {}, "By status"), statusTable(),
    el("h2", {}, "By failure reason"), reasonTable(),
    el("h2", {}, "Durations"), histogram(),
    el("h2", {}, `Slowest ${DATA.slowest.length}`), ...runTable("slowest", DATA.slowest),
    el("h2", {}, `Failed (${count(DATA.failed_total)})`), failedNote,
    ...(DATA.failed.length ? runTable("failed", DATA.failed) : [el("p", {class: "cut", id: "failed"}, "None.")]));
}

render();
ready();

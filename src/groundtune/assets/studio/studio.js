// groundtune studio: the page's behaviour. Every action is a call to the studio's own endpoints
// (studio/app.py's table); the page holds no state the studio could not give again.
"use strict";

const $ = (id) => document.getElementById(id);
const COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
const POLL_MS = 1500;

function say(text, error = false) {
  const box = $("message");
  box.textContent = text;
  box.className = text ? (error ? "error" : "note") : "";
}

async function api(path, body) {
  // a POST carries the studio's own header (safety.py): a form of another site cannot send it
  const options = body === undefined ? {} : {method: "POST", body: JSON.stringify(body),
    headers: {"Content-Type": "application/json", "x-groundtune-studio": "1"}};
  const response = await fetch(path, options);
  const answer = await response.json().catch(() => ({error: response.statusText}));
  if (!response.ok) {
    say(answer.error || response.statusText, true);
    throw new Error(answer.error);
  }
  return answer;
}

// an action of the page: its refusal is already in the message line
const act = (fn) => (...args) => fn(...args).catch((e) => console.log(e.message));
const query = (params) => new URLSearchParams(params).toString();

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k === "style") node.style.cssText = v; else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

function options(select, values, keep = true) {
  const before = select.value;
  select.replaceChildren(...values.map(([value, label]) => el("option", {value}, label)));
  if (keep && values.some(([v]) => v === before)) select.value = before;
}

// ---------------------------------------------------------------------------------------------
// tabs

const visible = () => document.querySelector("nav button.active").dataset.tab;
for (const button of document.querySelectorAll("nav button")) {
  button.addEventListener("click", () => {
    document.querySelectorAll("nav button, .tab").forEach((n) => n.classList.remove("active"));
    button.classList.add("active");
    $("tab-" + button.dataset.tab).classList.add("active");
    say("");
    ({launch: loadForm, watch: refreshRuns, judge: refreshJudge, try: refreshTry}[button.dataset.tab] || (() => 0))();
  });
}

// ---------------------------------------------------------------------------------------------
// Data

const data = {file: null, offset: 0, checkJob: null};

async function openData(event) {
  event?.preventDefault();
  const opened = await api("/api/data/open", {file: $("data-file").value});
  data.file = opened.file;
  say("");
  const first = opened.first_unusable;
  $("data-summary").textContent = `${opened.file}: ${opened.lines} lines` + (opened.unusable ?
    `, ${opened.unusable} not usable (line ${first.line}: ${first.error})` : "");
  const any = [["", "any"]];
  options($("f-split"), any.concat(Object.entries(opened.splits).map(([k, n]) => [k, `${k} (${n})`])));
  options($("f-source"), any.concat(Object.entries(opened.sources).map(([k, n]) => [k, `${k} (${n})`])));
  options($("f-targets"), any.concat(Object.entries(opened.targets).map(([k, n]) => [k, `${k} (${n})`])));
  showCheck(opened.check);
  $("data-check").disabled = false;
  await loadSamples(0);
}

function showCheck(check) {
  const problems = [["", "any"], ["any", "with a problem"], ["none", "without"]];
  const report = check.report;
  if (report) {
    for (const level of ["errors", "warnings"]) {
      for (const [kind, lines] of Object.entries(report[level])) problems.push([kind, `${kind} (${lines.length})`]);
    }
  }
  options($("f-problem"), report ? problems : [["", "run the data check"]]);
  const words = {none: "", running: `checking… ${check.seconds} s`, done: report ?
    `checked: ${Object.keys(report.errors).length} kinds of error, ${Object.keys(report.warnings).length} of warning` : "",
    failed: "the check failed: " + (check.tail || ""), cancelled: "check cancelled"};
  $("data-check-state").textContent = words[check.state] ?? check.state;
  $("data-check-cancel").hidden = check.state !== "running";
  data.checkJob = check.state === "running" ? check.id : null;
}

async function loadSamples(offset) {
  const filters = {file: data.file, split: $("f-split").value, source: $("f-source").value,
    targets: $("f-targets").value, problem: $("f-problem").value, offset};
  const page = await api("/api/data/samples?" + query(filters));
  if (offset === 0) $("data-grid").replaceChildren();
  for (const sample of page.samples) $("data-grid").append(sampleCard(sample));
  data.offset = offset + page.samples.length;
  $("data-count").textContent = `${page.total} samples`;
  $("data-more").hidden = data.offset >= page.total;
}

function sampleCard(sample) {
  const thumb = el("div", {class: "thumb"});
  const image = el("img", {src: "/api/data/image?" + query({file: data.file, line: sample.line}), alt: ""});
  image.addEventListener("error", () => thumb.replaceChildren(el("p", {class: "error-text"}, "image not shown")));
  thumb.append(image);
  if (sample.width && sample.height) {
    // the picture keeps the image's shape: a box is placed in shares of its width and height
    const [w, h] = [sample.width, sample.height];
    for (const [x1, y1, x2, y2] of sample.boxes) {
      thumb.append(el("div", {class: "box", style: `left:${x1 / w * 100}%;top:${y1 / h * 100}%;` +
        `width:${(x2 - x1) / w * 100}%;height:${(y2 - y1) / h * 100}%`}));
    }
  }
  const problems = sample.error ? [sample.error] : sample.problems;
  return el("div", {class: "card", "data-line": sample.line, "data-boxes": sample.boxes.length,
      onclick: () => showSample(sample.line)}, thumb,
    el("div", {}, el("b", {}, sample.phrase ?? "")),
    el("div", {}, `line ${sample.line} · ${sample.split ?? "-"} · ${sample.targets ?? "?"} target(s)`),
    el("div", {class: "problem"}, problems.join(", ")));
}

function showSample(line) {
  data.line = line;
  $("data-view").src = "/api/data/view?" + query({file: data.file, line, family: $("data-family").value,
    max_pixels: $("data-max-pixels").value});
}

async function startCheck() {
  const job = await api("/api/data/check", {file: data.file});
  showCheck(job);
  pollCheck();
}

async function pollCheck() {
  const opened = await api("/api/data/open", {file: data.file});
  showCheck(opened.check);
  if (opened.check.state === "running") setTimeout(act(pollCheck), POLL_MS);
}

$("data-form").addEventListener("submit", act(openData));
$("data-check").addEventListener("click", act(startCheck));
$("data-check-cancel").addEventListener("click", act(async () => {
  await api("/api/jobs/cancel", {job: data.checkJob});
}));
$("data-more").addEventListener("click", act(() => loadSamples(data.offset)));
for (const id of ["f-split", "f-source", "f-targets", "f-problem"]) $(id).addEventListener("change", act(() => loadSamples(0)));
for (const id of ["data-family", "data-max-pixels"]) $(id).addEventListener("change", () => data.line && showSample(data.line));

// ---------------------------------------------------------------------------------------------
// Plan & launch

async function loadForm() {
  const form = await api("/api/launch/form?" + query({command: $("launch-command").value,
    preset: $("launch-preset").value}));
  options($("launch-preset"), form.presets.map((p) => [p, p]), false);
  $("launch-preset").value = form.preset;
  if (!$("launch-card").options.length) {
    options($("launch-card"), form.cards.map((c) => [c.key, c.name]));
    $("launch-card").value = form.card;
  }
  const groups = {};
  for (const f of form.fields) {
    const input = f.bool ? el("input", {type: "checkbox", "data-name": f.name})
      : el("input", {value: f.value, "data-name": f.name, size: 28});
    if (f.bool) input.checked = f.value === "true";
    const label = el("label", {}, el("span", {}, f.name), input, el("small", {}, `${f.help} (default: ${f.default || '""'})`));
    (groups[f.group] ||= el("fieldset", {}, el("legend", {}, f.group))).append(label);
  }
  $("launch-form").replaceChildren(...Object.values(groups));
  unplanned();
  refreshJobs();
}

function unplanned() {
  $("launch-start").disabled = true;
  $("plan-verdict").className = "";
}

function launchRequest() {
  const settings = {};
  for (const input of $("launch-form").querySelectorAll("input[data-name]")) {
    settings[input.dataset.name] = input.type === "checkbox" ? String(input.checked) : input.value;
  }
  return {command: $("launch-command").value, preset: $("launch-preset").value, card: $("launch-card").value, settings};
}

async function plan() {
  $("plan-verdict").textContent = "planning…";
  const verdict = await api("/api/launch/plan", launchRequest());
  $("plan-verdict").textContent = verdict.text;
  $("plan-verdict").className = verdict.fits === false ? "nofit" : "fits";
  $("launch-start").disabled = false;  // a plan that does not fit may still be started: the user decides
}

async function start() {
  const job = await api("/api/launch/start", launchRequest());
  say(`started: ${job.command} (run folder ${job.run}); its curves are in Watch`);
  unplanned();
  refreshJobs();
}

function jobCard(job) {
  const buttons = [];
  const isRun = job.kind === "train" || job.kind === "rl";
  if (isRun && job.state === "running") buttons.push(el("button", {class: "job-stop", onclick: act(() => stopRun(job.run))}, "Stop (STOP file)"));
  if (isRun && job.state !== "running") buttons.push(el("button", {class: "job-resume", onclick: act(() => resumeRun(job.run))}, "Resume"));
  if (!isRun && job.state === "running") buttons.push(el("button", {class: "job-cancel",
    onclick: act(() => api("/api/jobs/cancel", {job: job.id}).then(refreshJobs))}, "Cancel"));
  return el("div", {class: "job", "data-job": job.id, "data-state": job.state},
    el("div", {}, el("b", {}, job.command), " ", el("span", {class: "state-" + job.state}, `${job.state}, ${job.seconds} s`), " ", ...buttons),
    el("pre", {}, job.tail));
}

let jobsTimer = null;
async function refreshJobs() {
  clearTimeout(jobsTimer);
  const {jobs} = await api("/api/jobs");
  $("jobs").replaceChildren(...jobs.map(jobCard));
  if (jobs.some((j) => j.state === "running")) jobsTimer = setTimeout(act(refreshJobs), POLL_MS);
}

async function stopRun(run) {
  const stopped = await api("/api/runs/stop", {run});
  say(`wrote ${stopped.stop}: the run saves a checkpoint at the end of its step and stops`);
  refreshJobs();
  refreshRuns();
}

async function resumeRun(run) {
  const job = await api("/api/runs/resume", {run});
  say(`resumed: ${job.command}`);
  refreshJobs();
  refreshRuns();
}

$("launch-command").addEventListener("change", act(async () => { $("launch-preset").value = ""; await loadForm(); }));
$("launch-preset").addEventListener("change", act(loadForm));
$("launch-card").addEventListener("change", unplanned);
$("launch-form").addEventListener("input", unplanned);
$("launch-form").addEventListener("submit", (e) => e.preventDefault());
$("launch-plan").addEventListener("click", act(plan));
$("launch-start").addEventListener("click", act(start));

// ---------------------------------------------------------------------------------------------
// Watch

const CHARTS = [
  ["loss", (k) => k === "loss"], ["learning rate", (k) => k === "lr"],
  ["throughput (per s)", (k) => k === "samples_per_s" || k === "rollouts_per_s"],
  ["GPU memory (GiB)", (k) => k === "gpu_mem_peak_gib" || k === "gpu_mem_alloc_gib"],
  ["eval: Acc@0.5, F1@0.5", (k) => k === "eval/acc@0.5" || k === "eval/f1@0.5"],
  ["reward", (k) => k === "reward/mean" || k === "rollout/iou"],
];
const watch = {chosen: new Set(), known: new Set(), timer: null, runs: []};

async function refreshRuns() {
  const {runs} = await api("/api/runs");
  watch.runs = runs;
  for (const r of runs) {
    if (!watch.known.has(r.run) && (r.running || watch.chosen.size === 0)) watch.chosen.add(r.run);
    watch.known.add(r.run);
  }
  $("watch-runs").replaceChildren(...(runs.length ? runs.map(runRow) : [el("p", {}, "no run in the work folder yet: start one in Plan & launch")]));
  clearTimeout(watch.timer);
  await refreshCurves();
}

function runRow(r) {
  const box = el("input", {type: "checkbox", "data-run": r.run});
  box.checked = watch.chosen.has(r.run);
  box.addEventListener("change", act(async () => {
    box.checked ? watch.chosen.add(r.run) : watch.chosen.delete(r.run);
    await refreshCurves();
  }));
  const control = r.running ? el("button", {class: "run-stop", onclick: act(() => stopRun(r.run))}, "Stop")
    : el("button", {class: "run-resume", onclick: act(() => resumeRun(r.run))}, "Resume");
  return el("div", {class: "row"}, el("label", {}, box, ` ${r.run}`),
    el("span", {}, `${r.command}, step ${r.step ?? "-"}${r.running ? ", running" : ""}${r.has_model ? ", has a model" : ""}`), control);
}

async function refreshCurves() {
  clearTimeout(watch.timer);
  const chosen = [...watch.chosen];
  const {series} = chosen.length ? await api("/api/runs/metrics?" + query({runs: chosen.join(",")})) : {series: {}};
  drawLatest(series);
  $("charts").replaceChildren(...CHARTS.map(([title, wanted]) => chart(title, series, wanted)));
  if (chosen.length) await latestEval(chosen[0]);
  // followed while the tab is shown: a run just started has no folder for a second or two
  if (visible() === "watch") watch.timer = setTimeout(act(refreshRunsQuietly), POLL_MS);
}

async function refreshRunsQuietly() {
  if (visible() === "watch") await refreshRuns();
}

function last(points) { return points && points.length ? points[points.length - 1][1] : null; }
const fmt = (v, digits = 4) => v === null || v === undefined ? "-" : Number(v).toPrecision(digits);

function drawLatest(series) {
  const rows = Object.entries(series).map(([run, s]) => el("tr", {"data-run": run}, el("td", {}, run),
    el("td", {class: "step"}, s.loss ? s.loss[s.loss.length - 1][0] : "-"), el("td", {class: "loss"}, fmt(last(s.loss))),
    el("td", {}, fmt(last(s.lr), 3)), el("td", {}, fmt(last(s.samples_per_s || s.rollouts_per_s), 3)),
    el("td", {}, fmt(last(s["eval/acc@0.5"] || s["eval/f1@0.5"]), 3))));
  $("watch-latest").replaceChildren(el("tr", {}, ...["run", "step", "loss", "lr", "per s", "eval"].map((h) => el("th", {}, h))), ...rows);
}

function chart(title, series, wanted) {
  const lines = [];
  Object.entries(series).forEach(([run, s]) => {
    for (const [name, points] of Object.entries(s)) if (wanted(name)) lines.push({label: `${run} ${name}`, points});
  });
  const box = el("div", {class: "chart"}, el("b", {}, title));
  if (!lines.length) return box.append(el("p", {}, "nothing logged yet" + (title.startsWith("GPU") ? " (a CPU run logs none)" : ""))) || box;
  const all = lines.flatMap((l) => l.points);
  const [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  const [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  const X = (x) => 40 + 350 * (x - x0) / ((x1 - x0) || 1), Y = (y) => 190 - 170 * (y - y0) / ((y1 - y0) || 1);
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", "0 0 400 210");
  const text = (x, y, t) => { const n = document.createElementNS(ns, "text"); n.setAttribute("x", x); n.setAttribute("y", y);
    n.setAttribute("font-size", "10"); n.textContent = t; svg.append(n); };
  text(2, 22, fmt(y1, 3)); text(2, 192, fmt(y0, 3)); text(40, 205, `step ${x0}`); text(340, 205, `${x1}`);
  lines.forEach((line, i) => {
    const path = document.createElementNS(ns, "polyline");
    path.setAttribute("points", line.points.map(([x, y]) => `${X(x)},${Y(y)}`).join(" "));
    path.setAttribute("fill", "none");
    path.setAttribute("stroke", COLOURS[i % COLOURS.length]);
    path.setAttribute("stroke-width", "1.5");
    svg.append(path);
    if (line.points.length > 40) return;
    for (const [x, y] of line.points) {  // few points (evals): each one seen, a single one too
      const dot = document.createElementNS(ns, "circle");
      dot.setAttribute("cx", X(x)); dot.setAttribute("cy", Y(y)); dot.setAttribute("r", "2.5");
      dot.setAttribute("fill", COLOURS[i % COLOURS.length]);
      svg.append(dot);
    }
  });
  box.append(svg, el("div", {class: "legend"}, ...lines.map((l, i) => el("span", {style: `color:${COLOURS[i % COLOURS.length]}`}, l.label))));
  return box;
}

async function latestEval(run) {
  const found = await api("/api/runs/latest-eval?" + query({run}));
  const shown = `${run}, step ${found.step}`;
  if ($("watch-eval").dataset.shown === shown) return;  // the same eval: its pictures stay as they are
  $("watch-eval").dataset.shown = shown;
  $("watch-eval-run").textContent = found.step === null ? `${run} (no eval yet)` : shown;
  $("watch-eval").replaceChildren(...found.worst.map((a) => answerCard(a, "worst")), ...found.best.map((a) => answerCard(a, "best")));
}

function answerCard(a, tag = "") {
  return el("div", {class: "card " + (a.right ? "right" : "wrong"), "data-iou": a.iou ?? "", "data-index": a.index},
    el("img", {src: "/api/answer.png?" + query({file: a.file, index: a.index}), alt: ""}),
    el("div", {}, el("b", {}, a.phrase)), el("div", {}, (tag ? tag + ": " : "") + a.verdict),
    el("div", {}, `${a.split ?? "-"} · ${a.targets} target(s) · ${a.id}`));
}

// ---------------------------------------------------------------------------------------------
// Judge

const judge = {job: null, timer: null};

async function refreshJudge() {
  const [{runs}, {evals}] = await Promise.all([api("/api/runs"), api("/api/judge/evals")]);
  judge.runs = runs;
  options($("judge-model"), [["tiny", "tiny (the built-in model)"]].concat(runs.filter((r) => r.has_model).map((r) => [r.run, r.run])));
  const named = evals.map((e) => [e.eval, `${e.eval}: acc@0.5 ${fmt(e["acc@0.5"], 3)}, n ${e.n}`]);
  options($("judge-eval"), named);
  options($("judge-b"), [["", "(none)"]].concat(named));
  if (evals.length) await loadAnswers();
}

async function runEval() {
  const job = await api("/api/judge/eval", {model: $("judge-model").value, data: $("judge-data").value,
    limit: $("judge-limit").value});
  judge.job = job.id;
  followEval(job);
}

function followEval(job) {
  const cancel = el("button", {class: "job-cancel", onclick: act(() => api("/api/jobs/cancel", {job: job.id}))}, "Cancel");
  $("judge-job").replaceChildren(`${job.command}: ${job.state}, ${job.seconds} s `, ...(job.state === "running" ? [cancel] : []),
    ...(job.state === "failed" ? [el("pre", {}, job.tail)] : []));
  if (job.state === "running") {
    judge.timer = setTimeout(act(async () => {
      const {jobs} = await api("/api/jobs");
      followEval(jobs.find((j) => j.id === job.id));
    }), POLL_MS);
  } else if (job.state === "done") {
    refreshJudge().then(() => { $("judge-eval").value = job.eval; return loadAnswers(); }).catch(() => 0);
  }
}

async function loadAnswers() {
  const [a, b] = [$("judge-eval").value, $("judge-b").value];
  if (!a) return;
  if (b) {
    const found = await api("/api/judge/compare?" + query({a, b, filter: $("judge-filter").value}));
    $("judge-summary").textContent = `${found.total} of ${found.shared} shared samples (left: ${a}; beside: ${b})`;
    $("judge-list").replaceChildren(...found.pairs.map((p) => el("div", {class: "pair"}, answerCard(p.a), answerCard(p.b))));
    return;
  }
  const found = await api("/api/judge/answers?" + query({eval: a, sort: $("judge-sort").value,
    order: $("judge-order").value, split: $("judge-split").value}));
  options($("judge-split"), [["", "any"]].concat(found.splits.map((s) => [s, s])));
  $("judge-summary").textContent = `${found.total} answers` + (found.total > found.answers.length ? ` (the first ${found.answers.length} shown)` : "");
  $("judge-list").replaceChildren(...found.answers.map((x) => answerCard(x)));
}

$("judge-run").addEventListener("click", act(runEval));
$("judge-model").addEventListener("change", () => {
  // propose the data the run was evaluated on while it trained, unless some is typed already
  const run = (judge.runs || []).find((r) => r.run === $("judge-model").value);
  if (run && run.eval_data && !$("judge-data").value) $("judge-data").value = run.eval_data;
});
for (const id of ["judge-eval", "judge-b", "judge-sort", "judge-order", "judge-split", "judge-filter"]) {
  $(id).addEventListener("change", act(loadAnswers));
}

// ---------------------------------------------------------------------------------------------
// Try

const tryState = {image: null, bitmap: null};

async function refreshTry() {
  const {runs} = await api("/api/runs");
  options($("try-model"), [["tiny", "tiny (the built-in model)"]].concat(runs.filter((r) => r.has_model).map((r) => [r.run, r.run])));
}

$("try-image").addEventListener("change", act(async () => {
  const file = $("try-image").files[0];
  if (!file) return;
  tryState.image = await new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
  tryState.bitmap = await createImageBitmap(file, {imageOrientation: "from-image"});
  drawTry([]);
}));

function drawTry(results) {
  const canvas = $("try-canvas"), bitmap = tryState.bitmap;
  if (!bitmap) return;
  const scale = Math.max(1, Math.floor(480 / Math.max(bitmap.width, bitmap.height)));  // small images enlarged
  canvas.width = bitmap.width * scale;
  canvas.height = bitmap.height * scale;
  const ctx = canvas.getContext("2d");
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(bitmap, 0, 0, canvas.width, canvas.height);
  ctx.lineWidth = Math.max(2, canvas.width / 200);
  results.forEach((r, i) => {
    ctx.strokeStyle = COLOURS[i % COLOURS.length];
    for (const [x1, y1, x2, y2] of r.boxes) ctx.strokeRect(x1 * scale, y1 * scale, (x2 - x1) * scale, (y2 - y1) * scale);
  });
}

async function ground() {
  const started = Date.now();
  const timer = setInterval(() => say(`answering… ${Math.round((Date.now() - started) / 1000)} s (the first question loads the model)`), 500);
  try {
    const answer = await api("/api/try", {model: $("try-model").value, image: tryState.image, phrases: $("try-phrases").value});
    say("");
    drawTry(answer.results);
    const total = answer.results.reduce((n, r) => n + r.boxes.length, 0);
    $("try-result").setAttribute("data-boxes", total);
    $("try-result").replaceChildren(...answer.results.map((r, i) => el("div", {class: "try-answer"},
      el("b", {style: `color:${COLOURS[i % COLOURS.length]}`}, r.phrase), ": ",
      r.boxes.length ? r.boxes.map((b) => `[${b.join(", ")}]`).join(" ") : r.no_target ? "no target (the model answered none)" : `no box (${r.error})`)));
  } finally {
    clearInterval(timer);
  }
}

$("try-go").addEventListener("click", act(ground));

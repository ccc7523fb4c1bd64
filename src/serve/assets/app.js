// cadenza studio: the page's logic. Plain JavaScript, nothing fetched but
// this server's own API.
"use strict";

const $ = (id) => document.getElementById(id);
const NUMBER_FIELDS = ["prompt_bars", "tokens", "temperature", "top_k", "top_p", "num_samples"];
const STATS = [
  ["notes", "notes", 0],
  ["bars", "bars", 0],
  ["notes_per_bar", "notes per bar", 2],
  ["pitch_class_entropy", "pitch-class entropy (1 bar)", 2],
  ["pitch_class_entropy_4bar", "pitch-class entropy (4 bars)", 2],
  ["grooving_similarity", "grooving similarity", 3],
  ["polyphony", "polyphony", 2],
  ["pitch_range", "pitch range", 0],
  ["pitch_range_8bar", "pitch range (8 bars)", 1],
  ["empty_bar_share", "empty bars", 3],
  ["scale_consistency", "scale consistency", 3],
];
// Seconds a bar lasts when nothing says otherwise: 4/4 at 120 beats a minute.
const DEFAULT_BAR_SECONDS = 2.0;
// Where the page remembers the job it is following, across reloads.
const JOB_KEY = "cadenza-studio-job";

const studio = { info: null, prompt: null, job: null, timer: null, lastPiece: null };

async function api(method, url, body, headers) {
  const r = await fetch(url, { method, body, headers });
  let data = null;
  try {
    data = await r.json();
  } catch (_) {
    data = { error: `the studio answered ${r.status} ${r.statusText}` };
  }
  if (!r.ok) {
    const e = new Error((data && data.error) || `${r.status} ${r.statusText}`);
    e.status = r.status;
    e.busy = r.status === 503;
    throw e;
  }
  return data;
}

function show(el, text) {
  el.textContent = text || "";
  el.hidden = !text;
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null) continue;
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}

function fmt(x, digits) {
  return typeof x === "number" ? x.toFixed(digits) : "–";
}

// 75.4 -> "1:15"
function clock(seconds) {
  const s = Math.max(0, Math.round(seconds));
  return `${Math.floor(s / 60)}:${String(s % 60).padStart(2, "0")}`;
}

// ---- the prompt ----

function setPrompt(p) {
  studio.prompt = p;
  show($("prompt-error"), "");
  if (!p) {
    $("prompt-status").textContent = "No prompt: the model starts from nothing.";
    delete $("prompt-status").dataset.promptId;
    lengthHint();
    return;
  }
  let text = `Prompt: ${p.name} (${p.source}) — ${p.bars} bars, ${p.notes} notes, ` +
    `${p.tokens} tokens, ${clock(p.seconds)}.`;
  if (p.warnings.length) text += ` Warnings: ${p.warnings.join("; ")}.`;
  $("prompt-status").textContent = text;
  $("prompt-status").dataset.promptId = p.id;
  lengthHint();
}

function promptFailed(e) {
  setPrompt(null);
  show($("prompt-error"), e.message);
}

async function uploadPrompt(file) {
  if (!file) return;
  $("sample-select").value = "";
  if (studio.info && file.size > studio.info.max_upload_bytes) {
    promptFailed(new Error(`${file.name} is larger than the limit of ` +
      `${Math.ceil(studio.info.max_upload_bytes / 1024)} KiB`));
    return;
  }
  $("prompt-status").textContent = `Reading ${file.name}…`;
  try {
    const bytes = await file.arrayBuffer();
    const p = await api("POST", `/api/prompts?name=${encodeURIComponent(file.name)}`, bytes,
      { "Content-Type": "audio/midi" });
    setPrompt(p);
  } catch (e) {
    promptFailed(e);
  }
}

async function pickSample(name) {
  if (!name) return;
  $("prompt-file").value = "";
  $("prompt-status").textContent = `Reading ${name}…`;
  try {
    setPrompt(await api("POST", `/api/prompts/sample/${encodeURIComponent(name)}`));
  } catch (e) {
    promptFailed(e);
  }
}

async function continuePiece(piece) {
  $("sample-select").value = "";
  $("prompt-file").value = "";
  try {
    setPrompt(await api("POST", `/api/prompts/piece/${piece.id}`));
    // The whole piece is the prompt; what was typed before comes back with
    // the next sample or upload.
    if ($("prompt_bars").value !== "") $("prompt_bars").dataset.before = $("prompt_bars").value;
    $("prompt_bars").value = "";
    $("setup").scrollIntoView({ behavior: "smooth" });
  } catch (e) {
    promptFailed(e);
  }
}

// ---- length and its expected duration ----

// Seconds a bar of the piece will probably last: the prompt's, else the
// last piece's, else 4/4 at 120.
function barSeconds() {
  const p = studio.prompt;
  if (p && p.bars > 0 && p.seconds > 0) return p.seconds / p.bars;
  const last = studio.lastPiece;
  if (last && last.stats.bars > 0 && last.seconds > 0) return last.seconds / last.stats.bars;
  return DEFAULT_BAR_SECONDS;
}

// Tokens a bar takes, as far as anything tells (null when nothing does).
function barTokens() {
  const p = studio.prompt;
  if (p && p.bars > 0) return p.tokens / p.bars;
  const last = studio.lastPiece;
  if (last && last.stats.bars > 0) return last.tokens / last.stats.bars;
  return null;
}

// The length as bars (or null: as many as the token limit allows) and
// tokens, from the length field and its unit.
function lengthSettings() {
  const n = Number($("length").value);
  const unit = $("length_unit").value;
  const limit = Number($("tokens").value);
  if (unit === "tokens") return { bars: null, tokens: n };
  if (unit === "seconds") return { bars: Math.max(1, Math.round(n / barSeconds())), tokens: limit };
  return { bars: n, tokens: limit };
}

function lengthHint() {
  const hint = $("length-hint");
  const n = Number($("length").value);
  if (!(n > 0)) {
    hint.textContent = "How much music to add after the prompt.";
    return;
  }
  const bar = barSeconds();
  const unit = $("length_unit").value;
  let text;
  if (unit === "tokens") {
    const per = barTokens();
    text = per
      ? `About ${Math.round(n / per)} bars, ${clock((n / per) * bar)} of music.`
      : `${n} tokens; how long that sounds shows once a prompt or a piece is there.`;
  } else {
    const bars = lengthSettings().bars;
    text = `About ${clock(bars * bar)} of music (${bars} bars of about ${fmt(bar, 1)} s), ` +
      `at most ${$("tokens").value} tokens.`;
  }
  hint.textContent = text;
}

// ---- settings on the page ----

// A seed typed by the user, or null for a new one; throws a plain message.
function seedSetting() {
  const v = $("seed").value.trim();
  if (v === "") return null;
  const max = studio.info ? studio.info.max_seed : Number.MAX_SAFE_INTEGER;
  if (!/^[0-9]+$/.test(v) || BigInt(v) > BigInt(max)) {
    throw new Error(`The seed must be a whole number from 0 to ${max}, or empty for a new ` +
      "one each time.");
  }
  return Number(v);
}

function settings() {
  const s = { prompt: studio.prompt ? studio.prompt.id : null };
  for (const f of NUMBER_FIELDS) {
    const v = $(f).value.trim();
    s[f] = v === "" ? null : Number(v);
  }
  Object.assign(s, lengthSettings());
  s.seed = seedSetting();
  s.programs = $("programs").value.trim();
  s.set = $("set").checked;
  return s;
}

// Puts a job's settings back on the page (after a reload, or "again").
function applySettings(s) {
  for (const f of NUMBER_FIELDS) $(f).value = s[f] === null || s[f] === undefined ? "" : s[f];
  if (s.bars) {
    $("length").value = s.bars;
    $("length_unit").value = "bars";
  } else {
    $("length").value = s.tokens;
    $("length_unit").value = "tokens";
  }
  $("seed").value = s.seed === null || s.seed === undefined ? "" : String(s.seed);
  $("programs").value = s.programs;
  $("set").checked = s.set === true;
  programsHelp();
  lengthHint();
}

function instrumentName(part) {
  if (!studio.info) return part;
  if (part === "drums") return "drums";
  const i = studio.info.instruments.find((x) => String(x.program) === part);
  return i ? i.name : part;
}

function programsHelp() {
  const v = $("programs").value.trim();
  const help = $("programs-help");
  if (v === "prompt") help.textContent = "The prompt's instruments (any without a prompt).";
  else if (v === "any") help.textContent = "The model chooses the instruments.";
  else help.textContent = v.split(",").map((p) => instrumentName(p.trim())).join(", ");
}

function addInstrument(value) {
  if (value === "") return;
  const now = $("programs").value.trim();
  const parts = now === "prompt" || now === "any" || now === ""
    ? [] : now.split(",").map((p) => p.trim());
  if (!parts.includes(value)) parts.push(value);
  $("programs").value = parts.join(",");
  $("program-pick").value = "";
  programsHelp();
}

// ---- jobs ----

function busy(on) {
  $("generate").disabled = on;
  $("cancel").hidden = !on;
  $("cancel").disabled = false;
}

async function generate(ev) {
  if (ev) ev.preventDefault();
  show($("job-error"), "");
  let s;
  try {
    s = settings();
  } catch (e) {
    show($("job-error"), e.message);
    return;
  }
  busy(true);
  $("progress").hidden = true;
  try {
    const job = await api("POST", "/api/jobs", JSON.stringify(s),
      { "Content-Type": "application/json" });
    follow(job);
  } catch (e) {
    busy(false);
    show($("job-error"), e.message);
  }
}

function follow(job) {
  studio.job = job.id;
  try {
    localStorage.setItem(JOB_KEY, String(job.id));
  } catch (_) {
    // Private windows may refuse: the job is then found through /api/jobs.
  }
  busy(true);
  $("progress").hidden = false;
  showProgress(job);
  poll();
}

function showProgress(job) {
  const bar = $("progress-bar");
  bar.max = job.tokens_total;
  bar.value = job.tokens_done;
  const seed = `seed ${job.settings.seed}`;
  let text;
  switch (job.state) {
    case "queued":
      text = `waiting: ${job.queue_position || 0} job(s) ahead (${seed})`;
      break;
    case "running":
      text = `${job.tokens_done} / ${job.tokens_total} tokens, ` +
        `${fmt(job.tokens_per_second, 0)} tokens/s (${seed})`;
      break;
    case "rendering":
      text = `${job.tokens_done} tokens in ${fmt(job.elapsed_seconds, 1)} s; ` +
        "writing MIDI, audio and pictures…";
      break;
    default:
      text = `${job.state}: ${job.tokens_done} tokens in ${fmt(job.elapsed_seconds, 1)} s (${seed})`;
  }
  $("progress-text").textContent = text;
  $("progress").dataset.state = job.state;
}

function forget() {
  studio.job = null;
  try {
    localStorage.removeItem(JOB_KEY);
  } catch (_) {
    // nothing kept
  }
}

async function poll() {
  clearTimeout(studio.timer);
  if (studio.job === null) return;
  let job;
  try {
    job = await api("GET", `/api/jobs/${studio.job}`);
  } catch (e) {
    busy(false);
    forget();
    $("progress").hidden = true;
    show($("job-error"), e.status === 404
      ? "The job is gone: the studio was restarted. Its finished pieces are in the gallery."
      : `Lost touch with the studio: ${e.message}`);
    return;
  }
  showProgress(job);
  if (!["done", "failed", "cancelled"].includes(job.state)) {
    studio.timer = setTimeout(poll, 250);
    return;
  }
  busy(false);
  forget();
  if (job.state === "failed") {
    $("progress").hidden = true;
    show($("job-error"), job.error);
  }
  if (job.state === "cancelled") show($("job-error"), "Cancelled.");
  if (job.pieces.length) {
    studio.lastPiece = job.pieces[job.pieces.length - 1];
    const cards = job.pieces.map(pieceCard);
    if (job.pieces.length > 1) {
      cards.unshift(el("p", { class: "downloads" },
        el("a", { href: `/api/jobs/${job.id}/zip`, class: "all-job" },
          `Download all ${job.pieces.length} variations (zip)`)));
    }
    $("results").replaceChildren(...cards);
  }
  loadGallery();
}

async function cancelJob() {
  if (studio.job === null) return;
  $("cancel").disabled = true;
  try {
    await api("POST", `/api/jobs/${studio.job}/cancel`);
  } catch (e) {
    show($("job-error"), e.message);
  }
}

// The job this page (or another tab) started and that is still going.
async function resume() {
  let id = null;
  try {
    id = localStorage.getItem(JOB_KEY);
  } catch (_) {
    id = null;
  }
  let job = null;
  if (id !== null) {
    try {
      job = await api("GET", `/api/jobs/${Number(id)}`);
    } catch (_) {
      forget();
    }
  }
  if (!job || ["done", "failed", "cancelled"].includes(job.state)) {
    const { jobs } = await api("GET", "/api/jobs");
    job = jobs.length ? jobs[jobs.length - 1] : job;
  }
  if (!job) return;
  applySettings(job.settings);
  if (job.settings.prompt !== null) {
    try {
      setPrompt(await api("GET", `/api/prompts/${job.settings.prompt}`));
    } catch (_) {
      // forgotten prompt: the job still runs
    }
  }
  if (!["done", "failed", "cancelled"].includes(job.state)) follow(job);
}

// ---- the piano roll: notes drawn from the piece's MIDI file, a playhead
// that follows the audio, click to seek, the prompt's end marked ----

// Widest canvas drawn (browsers refuse much wider ones).
const MAX_CANVAS = 16000;
const ROW = 6; // pixels a semitone

function drawRoll(view) {
  const { data, canvas, piece } = view;
  const pps = view.pps;
  const lo = view.lo, hi = view.hi;
  const width = Math.max(1, Math.ceil(data.seconds * pps) + 2);
  const height = (hi - lo + 1) * ROW;
  canvas.width = width;
  canvas.height = height;
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  const g = canvas.getContext("2d");
  g.fillStyle = "#fff";
  g.fillRect(0, 0, width, height);
  // The prompt, shaded.
  if (piece.prompt_seconds) {
    g.fillStyle = "#eef2f7";
    g.fillRect(0, 0, piece.prompt_seconds * pps, height);
  }
  // Octaves (C) and bars.
  g.fillStyle = "#f0ede6";
  for (let p = lo; p <= hi; p++) if (p % 12 === 0) g.fillRect(0, (hi - p) * ROW, width, 1);
  g.fillStyle = "#ddd6c8";
  for (const b of data.bars) g.fillRect(Math.round(b * pps), 0, 1, height);
  for (const [t, d, pitch, drum, vel] of data.notes) {
    const alpha = 0.45 + 0.55 * (vel / 127);
    g.fillStyle = drum ? `rgba(170, 90, 40, ${alpha})` : `rgba(47, 93, 138, ${alpha})`;
    g.fillRect(t * pps, (hi - pitch) * ROW, Math.max(2, d * pps - 1), ROW - 1);
  }
  if (piece.prompt_seconds) {
    g.fillStyle = "#a22";
    g.fillRect(Math.round(piece.prompt_seconds * pps), 0, 2, height);
  }
  view.label.textContent = `${fmt(pps, pps < 10 ? 1 : 0)} px/s`;
  movePlayhead(view);
}

function movePlayhead(view) {
  const t = view.audio ? view.audio.currentTime : 0;
  const x = t * view.pps;
  view.head.style.transform = `translateX(${x}px)`;
  view.head.style.height = `${view.canvas.height}px`;
  // Keep the playhead in sight while playing.
  const box = view.scroller;
  if (view.audio && !view.audio.paused && (x < box.scrollLeft || x > box.scrollLeft + box.clientWidth - 20)) {
    box.scrollLeft = Math.max(0, x - box.clientWidth * 0.2);
  }
}

function zoom(view, factor) {
  const most = MAX_CANVAS / Math.max(view.data.seconds, 0.1);
  const least = Math.min(view.fit, 2);
  view.pps = Math.min(most, Math.max(least, view.pps * factor));
  drawRoll(view);
}

function follow_audio(view) {
  const tick = () => {
    movePlayhead(view);
    if (view.audio && !view.audio.paused) view.frame = requestAnimationFrame(tick);
  };
  if (!view.audio) return;
  view.audio.addEventListener("play", () => { view.frame = requestAnimationFrame(tick); });
  for (const ev of ["pause", "seeked", "timeupdate", "ended"]) {
    view.audio.addEventListener(ev, () => movePlayhead(view));
  }
}

function pianoRoll(piece, audio) {
  const canvas = el("canvas", { class: "roll-canvas", "aria-label": `piano roll of ${piece.name}` });
  const head = el("div", { class: "playhead" });
  const scroller = el("div", { class: "roll-scroll" }, el("div", { class: "roll-inner" }, canvas, head));
  const label = el("span", { class: "zoom-label" }, "");
  const view = { piece, audio, canvas, head, scroller, label, data: null, pps: 20, fit: 20, lo: 48, hi: 84 };
  const buttons = el("div", { class: "roll-tools" },
    el("button", { type: "button", class: "secondary small", title: "zoom out",
      onclick: () => view.data && zoom(view, 0.5) }, "−"),
    el("button", { type: "button", class: "secondary small", title: "zoom in",
      onclick: () => view.data && zoom(view, 2) }, "+"),
    el("button", { type: "button", class: "secondary small", title: "the whole piece",
      onclick: () => { if (view.data) { view.pps = view.fit; drawRoll(view); } } }, "fit"),
    label,
    el("span", { class: "help" }, piece.prompt_seconds
      ? " shaded: the prompt; red line: where the model takes over; click to play from there"
      : " click to play from there"));
  canvas.addEventListener("click", (e) => {
    const r = canvas.getBoundingClientRect();
    const t = (e.clientX - r.left) / view.pps;
    if (view.audio) {
      view.audio.currentTime = Math.max(0, Math.min(t, view.data ? view.data.seconds : t));
      if (view.audio.paused) view.audio.play().catch(() => {});
    }
  });
  api("GET", `/api/pieces/${piece.id}/notes`).then((data) => {
    view.data = data;
    const pitches = data.notes.map((n) => n[2]);
    view.lo = Math.max(0, Math.min(...pitches, 60) - 2);
    view.hi = Math.min(127, Math.max(...pitches, 60) + 2);
    const width = scroller.clientWidth || 600;
    view.fit = Math.max(0.5, Math.min(MAX_CANVAS / Math.max(data.seconds, 0.1),
      (width - 4) / Math.max(data.seconds, 0.1)));
    view.pps = Math.max(view.fit, Math.min(30, MAX_CANVAS / Math.max(data.seconds, 0.1)));
    drawRoll(view);
    scroller.dataset.ready = "1";
  }).catch((e) => {
    scroller.replaceChildren(el("p", { class: "error" }, `No piano roll: ${e.message}`));
  });
  follow_audio(view);
  return el("div", { class: "roll" }, buttons, scroller);
}

// ---- pieces ----

function statsTable(piece) {
  const head = el("tr", {}, el("th", {}, "statistic"),
    el("th", {}, piece.prompt_stats ? "prompt" : ""), el("th", {}, "piece"));
  const rows = STATS.map(([key, label, digits]) => el("tr", {},
    el("td", {}, label),
    el("td", {}, piece.prompt_stats ? fmt(piece.prompt_stats[key], digits) : ""),
    el("td", {}, fmt(piece.stats[key], digits))));
  return el("details", { class: "stats-fold" }, el("summary", {}, "Statistics"),
    el("table", { class: "stats" }, el("thead", {}, head), el("tbody", {}, ...rows)));
}

function again(piece) {
  applySettings(piece.settings);
  generate(null);
}

// New tokens kept, and why the progress counted more when it did.
function newTokens(piece) {
  const kept = piece.tokens - piece.prompt_tokens;
  const extra = (piece.drawn || kept) - kept;
  if (extra <= 0) return `${kept} new tokens`;
  return `${kept} new tokens of ${piece.drawn} drawn: the end mark or an unfinished ` +
    `note at the end is not kept`;
}

function pieceCard(piece) {
  const f = piece.files;
  const s = piece.settings;
  const link = (href, label) => el("a", { href, download: href.split("/").pop() }, label);
  const audio = f.wav
    ? el("audio", { controls: "", preload: "metadata", src: f.wav })
    : el("p", { class: "status" }, "No audio: the studio found no SoundFont.");
  return el("article", { class: "piece", "data-piece-id": piece.id },
    el("h3", {}, piece.name, el("small", {},
      piece.prompt_name ? ` after ${piece.prompt_name}` : " from nothing")),
    el("p", { class: "meta" },
      `${piece.stats.bars} bars, ${clock(piece.seconds)}, ${piece.notes} notes ` +
      `(${newTokens(piece)} after ${piece.prompt_tokens}); ` +
      `seed ${s.seed}, temperature ${s.temperature}, top-k ${s.top_k}, top-p ${s.top_p}, ` +
      `instruments ${s.programs}${s.set ? ", a set of tunes" : ""}, variation ${piece.index}`),
    piece.silent ? el("p", { class: "silent" }, piece.silent) : null,
    el("div", { class: "media" }, audio, pianoRoll(piece, f.wav ? audio : null)),
    statsTable(piece),
    el("p", { class: "downloads" }, "Download: ",
      el("a", { href: `/api/pieces/${piece.id}/zip`, download: `${piece.name}.zip`,
        class: "all" }, "all (zip)"), " ",
      link(f.midi, "MIDI"), " ", f.wav ? link(f.wav, "WAV") : null, " ",
      link(f.png, "roll picture"), " ", link(f.tokens, "tokens"), " ",
      link(f.settings, "settings")),
    el("div", { class: "actions" },
      el("button", { type: "button", class: "continue", onclick: () => continuePiece(piece) },
        "Continue this piece"),
      el("button", { type: "button", class: "again secondary", onclick: () => again(piece),
        title: "the same settings and seed: the same piece again" },
      `Again with seed ${s.seed}`)));
}

async function loadGallery() {
  try {
    const { pieces } = await api("GET", "/api/pieces");
    if (!pieces.length) return;
    if (!studio.lastPiece) studio.lastPiece = pieces[pieces.length - 1];
    $("gallery").replaceChildren(...pieces.slice().reverse().map(pieceCard));
  } catch (_) {
    // The gallery is refreshed after the next job.
  }
}

// ---- start ----

async function init() {
  $("settings").addEventListener("submit", generate);
  $("cancel").addEventListener("click", cancelJob);
  $("prompt-file").addEventListener("change", (e) => uploadPrompt(e.target.files[0]));
  $("sample-select").addEventListener("change", (e) => pickSample(e.target.value));
  $("prompt-clear").addEventListener("click", () => {
    $("sample-select").value = "";
    $("prompt-file").value = "";
    setPrompt(null);
  });
  $("seed-clear").addEventListener("click", () => {
    $("seed").value = "";
  });
  for (const id of ["length", "length_unit", "tokens"]) {
    $(id).addEventListener("input", lengthHint);
  }
  $("programs").addEventListener("input", programsHelp);
  $("program-pick").addEventListener("change", (e) => addInstrument(e.target.value));
  for (const id of ["sample-select", "prompt-file"]) {
    $(id).addEventListener("change", () => {
      const before = $("prompt_bars").dataset.before;
      if (before !== undefined && $("prompt_bars").value === "") $("prompt_bars").value = before;
      delete $("prompt_bars").dataset.before;
    });
  }
  try {
    const info = await api("GET", "/api/info");
    studio.info = info;
    $("model-info").textContent = `model ${info.model} (${info.preset}, ` +
      `${(info.parameters / 1e6).toFixed(2)} M parameters, ${info.vocab_size} tokens); ` +
      `up to ${info.max_tokens} tokens and ${info.max_samples} variations a job` +
      (info.audio ? "" : "; no SoundFont found, so no audio");
    for (const name of info.samples) {
      $("sample-select").append(el("option", { value: name }, name));
    }
    $("program-pick").append(el("option", { value: "drums" }, "Drums"));
    for (const i of info.instruments) {
      $("program-pick").append(el("option", { value: String(i.program) },
        `${i.program} ${i.name}`));
    }
    applySettings(info.defaults);
    $("tokens").max = info.max_tokens;
    $("num_samples").max = info.max_samples;
    await resume();
    document.body.dataset.ready = "1";
  } catch (e) {
    $("model-info").textContent = `cannot reach the studio: ${e.message}`;
  }
  loadGallery();
}

init();

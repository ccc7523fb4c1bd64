// cadenza studio: the page's logic. Plain JavaScript, nothing fetched but
// this server's own API.
"use strict";

const $ = (id) => document.getElementById(id);
const FIELDS = ["prompt_bars", "tokens", "temperature", "top_k", "top_p", "seed", "num_samples"];
const TEXT_FIELDS = ["programs"];
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

const studio = { info: null, prompt: null, job: null, timer: null };

async function api(method, url, body, headers) {
  const r = await fetch(url, { method, body, headers });
  let data = null;
  try {
    data = await r.json();
  } catch (_) {
    data = { error: `the server answered ${r.status} ${r.statusText}` };
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

// ---- the prompt ----

function setPrompt(p) {
  studio.prompt = p;
  show($("prompt-error"), "");
  if (!p) {
    $("prompt-status").textContent = "No prompt: the model starts from nothing.";
    return;
  }
  let text = `Prompt: ${p.name} (${p.source}) — ${p.bars} bars, ${p.notes} notes, ` +
    `${p.tokens} tokens, ${fmt(p.seconds, 1)} s.`;
  if (p.warnings.length) text += ` Warnings: ${p.warnings.join("; ")}.`;
  $("prompt-status").textContent = text;
  $("prompt-status").dataset.promptId = p.id;
}

function promptFailed(e) {
  studio.prompt = null;
  $("prompt-status").textContent = "No prompt: the model starts from nothing.";
  delete $("prompt-status").dataset.promptId;
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
    $("prompt_bars").value = "";
    $("setup").scrollIntoView({ behavior: "smooth" });
  } catch (e) {
    promptFailed(e);
  }
}

// ---- jobs ----

function settings() {
  const s = { prompt: studio.prompt ? studio.prompt.id : null };
  for (const f of FIELDS) {
    const v = $(f).value.trim();
    s[f] = v === "" ? null : Number(v);
  }
  for (const f of TEXT_FIELDS) s[f] = $(f).value.trim();
  return s;
}

function busy(on) {
  $("generate").disabled = on;
  $("cancel").hidden = !on;
  $("cancel").disabled = false;
}

async function generate(ev) {
  ev.preventDefault();
  show($("job-error"), "");
  busy(true);
  try {
    const job = await api("POST", "/api/jobs", JSON.stringify(settings()),
      { "Content-Type": "application/json" });
    studio.job = job.id;
    $("progress").hidden = false;
    showProgress(job);
    poll();
  } catch (e) {
    busy(false);
    show($("job-error"), e.message);
  }
}

function showProgress(job) {
  const bar = $("progress-bar");
  bar.max = job.tokens_total;
  bar.value = job.tokens_done;
  let text;
  switch (job.state) {
    case "queued":
      text = `waiting: ${job.queue_position || 0} job(s) ahead`;
      break;
    case "running":
      text = `${job.tokens_done} / ${job.tokens_total} tokens, ` +
        `${fmt(job.tokens_per_second, 0)} tokens/s`;
      break;
    case "rendering":
      text = `${job.tokens_done} tokens in ${fmt(job.elapsed_seconds, 1)} s; ` +
        "writing MIDI, audio and pictures…";
      break;
    default:
      text = `${job.state}: ${job.tokens_done} tokens in ${fmt(job.elapsed_seconds, 1)} s`;
  }
  $("progress-text").textContent = text;
  $("progress").dataset.state = job.state;
}

async function poll() {
  clearTimeout(studio.timer);
  if (studio.job === null) return;
  let job;
  try {
    job = await api("GET", `/api/jobs/${studio.job}`);
  } catch (e) {
    busy(false);
    show($("job-error"), e.message);
    return;
  }
  showProgress(job);
  if (!["done", "failed", "cancelled"].includes(job.state)) {
    studio.timer = setTimeout(poll, 250);
    return;
  }
  busy(false);
  studio.job = null;
  if (job.state === "failed") show($("job-error"), job.error);
  if (job.state === "cancelled") show($("job-error"), "Cancelled.");
  if (job.pieces.length) {
    const results = $("results");
    results.replaceChildren(...job.pieces.map(pieceCard));
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

// ---- pieces ----

function statsTable(piece) {
  const head = el("tr", {}, el("th", {}, "statistic"),
    el("th", {}, piece.prompt_stats ? "prompt" : ""), el("th", {}, "piece"));
  const rows = STATS.map(([key, label, digits]) => el("tr", {},
    el("td", {}, label),
    el("td", {}, piece.prompt_stats ? fmt(piece.prompt_stats[key], digits) : ""),
    el("td", {}, fmt(piece.stats[key], digits))));
  return el("table", { class: "stats" }, el("thead", {}, head), el("tbody", {}, ...rows));
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
      `${piece.tokens - piece.prompt_tokens} new tokens after ${piece.prompt_tokens}, ` +
      `${piece.notes} notes, ${fmt(piece.seconds, 1)} s; temperature ${s.temperature}, ` +
      `top-k ${s.top_k}, top-p ${s.top_p}, seed ${s.seed}, instruments ${s.programs}, ` +
      `sample ${piece.index}`),
    el("div", { class: "body" },
      el("div", { class: "media" },
        audio,
        el("img", { class: "roll", src: f.png, alt: `piano roll of ${piece.name}` })),
      statsTable(piece)),
    el("p", { class: "downloads" }, "Download: ", link(f.midi, "MIDI"), " ",
      f.wav ? link(f.wav, "WAV") : null, " ", link(f.tokens, "tokens"), " ",
      link(f.settings, "settings")),
    el("button", { type: "button", class: "continue", onclick: () => continuePiece(piece) },
      "Continue this piece"));
}

async function loadGallery() {
  try {
    const { pieces } = await api("GET", "/api/pieces");
    const g = $("gallery");
    if (!pieces.length) return;
    g.replaceChildren(...pieces.slice().reverse().map(pieceCard));
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
  try {
    const info = await api("GET", "/api/info");
    studio.info = info;
    $("model-info").textContent = `model ${info.model} (${info.preset}, ` +
      `${(info.parameters / 1e6).toFixed(2)} M parameters, ${info.vocab_size} tokens); ` +
      `up to ${info.max_tokens} tokens and ${info.max_samples} samples a job` +
      (info.audio ? "" : "; no SoundFont found, so no audio");
    for (const name of info.samples) {
      $("sample-select").append(el("option", { value: name }, name));
    }
    for (const f of FIELDS.concat(TEXT_FIELDS)) {
      const v = info.defaults[f];
      $(f).value = v === null || v === undefined ? "" : v;
    }
    $("tokens").max = info.max_tokens;
    $("num_samples").max = info.max_samples;
    document.body.dataset.ready = "1";
  } catch (e) {
    $("model-info").textContent = `cannot reach the studio: ${e.message}`;
  }
  loadGallery();
}

init();

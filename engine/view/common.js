"use strict";
// Shared by both pages. Everything from the data goes onto the page as text (textContent,
// attribute values set by the DOM), never as markup: the data holds what models and workers wrote.

const DATA = JSON.parse(document.getElementById("data").textContent);
const APP = document.getElementById("app");

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "style") node.setAttribute("style", value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function seconds(value) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (value < 1) return `${Math.round(value * 1000)} ms`;
  if (value < 60) return `${value.toFixed(value < 10 ? 2 : 1)} s`;
  const whole = Math.round(value), m = Math.floor(whole / 60), s = whole % 60;
  return m < 60 ? `${m}m${String(s).padStart(2, "0")}s` : `${Math.floor(m / 60)}h${String(m % 60).padStart(2, "0")}m`;
}

function count(value) { return (value || 0).toLocaleString("en-US"); }
function money(value) { return `$${(value || 0).toFixed(value >= 1 ? 2 : 4)}`; }

function fact(label, value) { return el("span", {}, `${label} `, el("b", {}, value)); }

function pill(status) {
  return el("span", {class: "pill", style: `background: var(--${/^[a-z_]+$/.test(status || "") ? status : "cancelled"})`}, status || "–");
}

function summarised() {
  // What the page left out or shortened to stay within its bounds, said where it is seen first.
  const said = DATA.summarised || [];
  return said.length ? el("div", {class: "warning", id: "summarised", role: "note"},
    "This page summarises: ", said.join("; "), ".") : null;
}

function ready() { document.body.dataset.ready = String(Math.round(performance.now())); }

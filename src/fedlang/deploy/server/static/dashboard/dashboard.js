// The operator's dashboard (docs/deploy.md, "The dashboard"). It reads the server's admin
// API with the admin token, which it keeps in this tab's sessionStorage, and polls it
// (every 2 s; `?interval=SECONDS` or the field in the header sets another period). It
// writes text only (no HTML from the server), and runs under the page's strict
// content-security policy (scripts from this server only, nothing inline).
import * as charts from './charts.js';

const TOKEN = 'fedlang.dashboard.token';
const INTERVAL = 'fedlang.dashboard.interval';
const $ = (id) => document.getElementById(id);
const RATES_SPAN = 5 * 60;  // the least time the rates chart spans (seconds)

// What the page shows, for tests and for the curious (window.fedlangDashboard).
const dashboard = {overview: null, metrics: new Map(), charts: new Map(), refreshes: 0, chartsLoaded: false};
window.fedlangDashboard = dashboard;

class Unauthorized extends Error {}

let token = null;
let timer = null;
let generation = 0;  // a logout or a new login ends the polling of the one before

async function api(path) {
  const response = await fetch(path, {headers: {Authorization: `Bearer ${token}`}, cache: 'no-store'});
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = null;
  }
  if (response.status === 401) throw new Unauthorized(body?.detail ?? 'The admin token was refused.');
  if (!response.ok) throw new Error(`${path} answered ${response.status}: ${body?.detail ?? response.statusText}`);
  return body;
}

// -- formatting

function number(v) {
  return v === null || v === undefined ? '' : String(Number(Number(v).toPrecision(4)));
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return '';
  if (seconds < 60) return `${seconds.toFixed(1)} s`;
  const m = Math.floor(seconds / 60);
  if (m < 60) return `${m} min ${String(Math.floor(seconds % 60)).padStart(2, '0')} s`;
  return `${Math.floor(m / 60)} h ${String(m % 60).padStart(2, '0')} min`;
}

function refused(byReason) {
  const entries = Object.entries(byReason ?? {}).filter(([, n]) => n > 0).sort();
  return entries.length === 0 ? '0' : entries.map(([reason, n]) => `${reason} ${n}`).join(', ');
}

function elapsed(item) {
  // the server's duration: to its end, or to now while open
  return item.state === 'open' ? `${duration(item.duration)} so far` : duration(item.duration);
}

function cell(content, {field = null, cls = null, title = null} = {}) {
  const td = document.createElement('td');
  if (content instanceof Node) td.append(content);
  else td.textContent = String(content ?? '');
  if (field) td.dataset.field = field;
  if (cls) td.className = cls;
  if (title) td.title = title;
  return td;
}

function progress(value, max) {
  const bar = document.createElement('progress');
  bar.max = Math.max(1, max ?? 1);
  bar.value = Math.min(value ?? 0, bar.max);
  const span = document.createElement('span');
  span.append(bar, document.createTextNode(`${value ?? 0} / ${max ?? '?'}`));
  return span;
}

function fill(section, rows, empty) {
  const body = $(section).querySelector('tbody');
  if (rows.length === 0) {
    const tr = document.createElement('tr');
    const td = cell(empty, {cls: 'empty'});
    td.colSpan = $(section).querySelectorAll('th').length;
    tr.append(td);
    rows = [tr];
  }
  body.replaceChildren(...rows);
}

// -- panels

function showPopulations(populations) {
  fill('populations', populations.map((p) => {
    const tr = document.createElement('tr');
    tr.dataset.population = p.name;
    tr.append(cell(p.name, {field: 'name'}), cell(p.enrolled, {field: 'enrolled', cls: 'num'}),
              cell(p.seen_last_hour, {field: 'seen_last_hour', cls: 'num'}),
              cell(p.finished ? 'finished' : 'active', {field: 'state'}));
    return tr;
  }), 'No populations yet.');
}

function showRounds(rounds) {
  const newest = [...rounds].sort((a, b) => b.id - a.id);
  fill('rounds', newest.map((r) => {
    const tr = document.createElement('tr');
    tr.dataset.round = r.id;
    tr.append(cell(r.id, {field: 'id'}), cell(r.population, {field: 'population'}),
              cell(r.state, {field: 'state', cls: `state-${r.state}`, title: r.failure || null}),
              cell(progress(r.reports, r.target), {field: 'reports'}),
              cell(r.dropouts, {field: 'dropouts', cls: 'num'}), cell(r.late, {field: 'late', cls: 'num'}),
              cell(refused(r.refused_by_reason), {field: 'refused'}), cell(elapsed(r), {field: 'duration'}));
    return tr;
  }), 'No rounds yet.');
}

function showSessions(sessions) {
  const newest = [...sessions].sort((a, b) => b.id - a.id);
  fill('sessions', newest.map((s) => {
    const tr = document.createElement('tr');
    tr.dataset.session = s.id;
    tr.append(cell(s.id, {field: 'id'}), cell(s.population, {field: 'population'}),
              cell(s.state, {field: 'state', cls: `state-${s.state}`}), cell(s.version, {field: 'version'}),
              cell(progress(s.buffer_fill, s.buffer_size), {field: 'buffer'}),
              cell(s.accepted, {field: 'accepted', cls: 'num'}),
              cell(refused(s.refused_by_reason), {field: 'refused'}), cell(elapsed(s), {field: 'duration'}));
    return tr;
  }), 'No buffered sessions.');
}

function showRefusals(totals) {
  // every refusal the server counted, by reason: reports and client requests, admin
  // requests without the token, and connections a connection budget closed or cut
  const kinds = [['reports and client requests', totals?.reports?.refused],
                 ['admin requests', totals?.admin_refused],
                 ['connections', totals?.connections_refused]];
  fill('refusals', kinds.map(([what, byReason]) => {
    const tr = document.createElement('tr');
    tr.dataset.kind = what;
    tr.append(cell(what, {field: 'kind'}), cell(refused(byReason), {field: 'refused'}));
    return tr;
  }), 'Nothing refused.');
}

function chart(key, container, options) {
  let c = dashboard.charts.get(key);
  if (c === undefined) {
    c = new charts.Chart(container, options);
    dashboard.charts.set(key, c);
  }
  return c;
}

function showRates(rates) {
  const series = [['check-ins', rates?.checkins ?? []], ['reports', rates?.reports ?? []]];
  const data = charts.join(series.map(([, points]) => [points.map((p) => p[0]), points.map((p) => p[1])]));
  const box = $('rates-chart');
  const c = chart('rates', box, {
    xLabel: 'time', yLabel: 'per minute', time: true,
    // from the first point (the server keeps the last hour), at least RATES_SPAN seconds:
    // a fresh server's few points are not dots at the right edge of an empty hour
    xRange: (first) => {
      const now = dashboard.overview.now;
      return [Math.min(first ?? now, now - RATES_SPAN), now + 60];
    },
    width: Math.max(480, Math.min(1100, box.clientWidth || 900)),
  });
  c.update(series.map(([name]) => name), data);
}

async function loadMetrics(population) {
  let known = dashboard.metrics.get(population);
  if (known === undefined) {
    known = {since: null, rows: new Map()};
    dashboard.metrics.set(population, known);
  }
  const query = known.since === null ? '' : `?since=${known.since}`;
  const got = await api(`/v1/admin/populations/${encodeURIComponent(population)}/metrics${query}`);
  for (const m of got.metrics) {
    known.rows.set(JSON.stringify([m.kind, m.name, m.round]), m);  // a release again replaces
    known.since = Math.max(known.since ?? m.released, m.released);
  }
  return known;
}

function figure(population, name) {
  const id = `metric-${population}-${name}`;
  let fig = document.getElementById(id);
  if (fig === null) {
    let group = document.getElementById(`metrics-of-${population}`);
    if (group === null) {
      group = document.createElement('div');
      group.id = `metrics-of-${population}`;
      const title = document.createElement('h3');
      title.textContent = population;
      const row = document.createElement('div');
      row.className = 'charts';
      group.append(title, row);
      $('metric-populations').append(group);
    }
    fig = document.createElement('figure');
    fig.id = id;
    fig.dataset.population = population;
    fig.dataset.metric = name;
    const plot = document.createElement('div');
    plot.className = 'chart';
    fig.append(plot, document.createElement('figcaption'));
    group.querySelector('.charts').append(fig);
  }
  return fig;
}

function showMetrics(population, rows) {
  const byName = new Map();
  for (const m of rows) {
    if (!byName.has(m.name)) byName.set(m.name, new Map());
    const kinds = byName.get(m.name);
    if (!kinds.has(m.kind)) kinds.set(m.kind, new Map());
    kinds.get(m.kind).set(m.round, m.value);
  }
  for (const [name, kinds] of [...byName].sort(([a], [b]) => a.localeCompare(b))) {
    const order = [...kinds.keys()].sort((a, b) => (a === 'train' ? -1 : b === 'train' ? 1 : a.localeCompare(b)));
    const data = charts.join(order.map((kind) => {
      const rounds = [...kinds.get(kind).keys()].sort((a, b) => a - b);
      return [rounds, rounds.map((r) => kinds.get(kind).get(r))];
    }));
    const fig = figure(population, name);
    // the axis says the last part of the name (`loss` of `client_work/train/loss`): a
    // whole name ran past the chart's height; the caption says it whole
    chart(`${population}/${name}`, fig.querySelector('.chart'),
          {xLabel: 'round', yLabel: name.split('/').pop()}).update(order, data);
    const caption = fig.querySelector('figcaption');
    const parts = [];
    const title = document.createElement('b');
    title.textContent = name;
    parts.push(title);
    for (const kind of order) {
      const rounds = [...kinds.get(kind).keys()].sort((a, b) => a - b);
      const last = rounds[rounds.length - 1];
      const span = document.createElement('span');
      span.dataset.kind = kind;
      span.textContent = ` · ${kind} ${number(kinds.get(kind).get(last))} (round ${last})`;
      parts.push(span);
    }
    caption.replaceChildren(...parts);
  }
  if (byName.size > 0) $('no-metrics').hidden = true;
}

// -- the loop

async function refresh() {
  const overview = await api('/v1/admin/overview');
  dashboard.overview = overview;
  showPopulations(overview.populations ?? []);
  showRounds(overview.rounds ?? []);
  showSessions(overview.sessions ?? []);
  showRefusals(overview.totals ?? {});
  showRates(overview.rates);
  for (const p of overview.populations ?? []) {
    const known = await loadMetrics(p.name);
    showMetrics(p.name, [...known.rows.values()]);
  }
  dashboard.refreshes += 1;
  $('updated').textContent = `updated ${new Date().toLocaleTimeString()}`;
}

function interval() {
  const v = Number($('interval').value);
  return Number.isFinite(v) ? Math.min(600, Math.max(0.5, v)) : 2;
}

function showError(e) {
  $('error').hidden = e === null;
  $('error').textContent = e === null ? '' : `Could not refresh: ${e.message}`;
}

async function poll(mine) {
  if (mine !== generation) return;
  try {
    await refresh();
    showError(null);
  } catch (e) {
    if (e instanceof Unauthorized) {
      logout(`The server refused the admin token (rotated?): ${e.message}`);
      return;
    }
    showError(e);
  }
  if (mine === generation) timer = setTimeout(() => poll(mine), interval() * 1000);
}

function showLogin(message = '') {
  $('board').hidden = true;
  $('controls').hidden = true;
  $('login').hidden = false;
  $('login-error').textContent = message;
  $('token').focus();
}

function logout(message = '') {
  generation += 1;
  clearTimeout(timer);
  token = null;
  sessionStorage.removeItem(TOKEN);
  // nothing of the deployment stays on the page
  dashboard.overview = null;
  dashboard.metrics.clear();
  for (const c of dashboard.charts.values()) c.plot?.destroy();
  dashboard.charts.clear();
  $('metric-populations').replaceChildren();
  $('no-metrics').hidden = false;
  for (const body of document.querySelectorAll('tbody')) body.replaceChildren();
  showLogin(message);
}

async function login(candidate) {
  generation += 1;
  const mine = generation;
  clearTimeout(timer);
  token = candidate;
  try {
    await refresh();
  } catch (e) {
    if (e instanceof Unauthorized) {
      logout(e.message);
      return;
    }
    showError(e);  // the token is right, the server had a hiccup: keep polling
  }
  if (mine !== generation) return;
  sessionStorage.setItem(TOKEN, candidate);
  $('login').hidden = true;
  $('board').hidden = false;
  $('controls').hidden = false;
  timer = setTimeout(() => poll(mine), interval() * 1000);
}

async function main() {
  const given = new URLSearchParams(location.search).get('interval') ?? sessionStorage.getItem(INTERVAL);
  if (given !== null && Number(given) > 0) $('interval').value = given;
  $('interval').value = String(interval());
  $('interval').addEventListener('change', () => {
    sessionStorage.setItem(INTERVAL, String(interval()));
    if (token !== null) {
      clearTimeout(timer);
      const mine = generation;
      timer = setTimeout(() => poll(mine), interval() * 1000);
    }
  });
  $('login').addEventListener('submit', (event) => {
    event.preventDefault();
    const candidate = $('token').value.trim();
    $('token').value = '';
    $('login-error').textContent = '';
    login(candidate);
  });
  $('logout').addEventListener('click', () => logout());
  dashboard.chartsLoaded = await charts.load();
  if (!dashboard.chartsLoaded) {
    $('charts-missing').hidden = false;
    $('charts-missing').textContent = 'The charting library (uPlot) is missing from this server: run '
      + '`python -m fedlang.deploy.assets` where fedlang is installed and restart the server. The '
      + 'tables still update.';
  }
  const saved = sessionStorage.getItem(TOKEN);
  if (saved) await login(saved);
  else showLogin();
}

main();

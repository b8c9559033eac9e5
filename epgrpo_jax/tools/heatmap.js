const Q = %(quantities)s, LIM = %(limits)s, NEG = %(neg)s, POS = %(pos)s, SEQ = %(seq)s,
  BUCKETS = %(buckets)s;
function mix(rgb, f) {
  f = Math.min(Math.max(f, 0), 1);
  return 'rgb(' + rgb.map(c => Math.round(255 + (c - 255) * f)).join(',') + ')';
}
function color(kind, v, lim) {
  if (kind === 'bucket') return BUCKETS[Math.round(v) %% BUCKETS.length];
  if (!isFinite(v)) return '#ffffff';
  const f = lim > 0 ? v / lim : 0;
  if (kind === 'signed') return mix(f >= 0 ? POS : NEG, Math.abs(f));
  return mix(SEQ[kind], f);
}
function fmt(v) { return Math.abs(v) >= 100 ? v.toFixed(0) : v.toPrecision(3); }
function show(key) {
  const q = Q[key], lim = LIM[key];
  document.querySelectorAll('.tok').forEach(s => {
    s.style.background = color(q.kind, parseFloat(s.dataset[q.attr]), lim);
  });
  document.querySelectorAll('button[data-q]').forEach(b => b.classList.toggle('on', b.dataset.q === key));
  document.getElementById('desc').innerHTML = q.desc;
  document.body.classList.toggle('nums', key === 'bucket' || key === 'tau');
  const bar = document.getElementById('bar'), t = document.getElementById('ticks').children;
  if (q.kind === 'signed') {
    bar.style.background = 'linear-gradient(to right,' + mix(NEG, 1) + ',#fff,' + mix(POS, 1) + ')';
    t[0].textContent = '−' + fmt(lim); t[1].textContent = '0'; t[2].textContent = '+' + fmt(lim);
  } else if (q.kind === 'bucket') {
    const n = Math.max(1, Math.round(lim)), w = 100 / n;
    bar.style.background = 'linear-gradient(to right,' + Array.from({length: n}, (_, i) =>
      BUCKETS[i %% BUCKETS.length] + ' ' + (i * w) + '%%,' + BUCKETS[i %% BUCKETS.length] + ' ' + ((i + 1) * w) + '%%').join(',') + ')';
    t[0].textContent = '0'; t[1].textContent = 'bucket'; t[2].textContent = String(n - 1);
  } else {
    bar.style.background = 'linear-gradient(to right,#fff,' + mix(SEQ[q.kind], 1) + ')';
    t[0].textContent = '0'; t[1].textContent = fmt(lim / 2); t[2].textContent = fmt(lim);
  }
  try { history.replaceState(null, '', '#' + key); } catch (e) {}
}
document.querySelectorAll('button[data-q]').forEach(b => b.addEventListener('click', () => show(b.dataset.q)));
const hover = document.getElementById('hover');
document.addEventListener('mouseover', e => {
  const s = e.target.closest && e.target.closest('.tok');
  if (s) hover.textContent = s.title.split('\n').join('   ');
});
show(Q[location.hash.slice(1)] ? location.hash.slice(1) : %(default)s);

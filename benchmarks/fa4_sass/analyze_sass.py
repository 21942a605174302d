#!/usr/bin/env python3
"""Find loops (backward branches) in an nvdisasm SASS listing and count instructions per
iteration by opcode class.  Usage: analyze_sass.py FILE.sass [--dump DIR]
A loop = [branch target label, backward BRA]; the count is the static straight-line body
(every instruction between the loop head and the back edge, incl. instructions inside
forward-branch-skipped sub-blocks, which are reported separately)."""
import re, sys, os, collections
INS = re.compile(r'/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;')
LAB = re.compile(r'^\s*(\.L_x_\d+):')
def classify(op, full):
    o = op.split('.')[0]
    if o == 'HGMMA': return 'HGMMA'
    if o in ('WARPGROUP', 'WARPSYNC'): return 'WARPGROUP/WARPSYNC'
    if o == 'BAR': return 'BAR (named barrier)'
    if o == 'SYNCS': return 'SYNCS (mbarrier)'
    if o == 'MUFU': return 'MUFU'
    if o in ('FMUL', 'FFMA', 'FADD', 'FMUL2', 'FFMA2', 'FADD2'): return 'FMUL/FFMA/FADD'
    if o in ('FMNMX', 'FSEL', 'FSETP', 'FSET', 'FCHK'): return 'FSEL/FSETP/FMNMX'
    if o in ('F2FP', 'F2F', 'F2I', 'I2F', 'I2FP', 'F2IP'): return 'F2FP/F2F/cvt'
    if o == 'SHFL': return 'SHFL'
    if o in ('STS', 'STSM', 'LDS', 'LDSM'): return o
    if o.startswith('UTMA') or o.startswith('UBLK') or o.startswith('UTMA'): return 'UTMA*/UBLK* (TMA/bulk)'
    if o in ('LDG', 'STG', 'RED', 'REDG', 'ATOM', 'ATOMG', 'ATOMS', 'LD', 'ST', 'LDL', 'STL'): return 'global/local mem'
    if o in ('MEMBAR', 'FENCE', 'CCTL', 'ERRBAR', 'DEPBAR'): return 'MEMBAR/FENCE/DEPBAR'
    if o in ('BRA', 'BSSY', 'BSYNC', 'EXIT', 'CALL', 'RET', 'BRX', 'JMP', 'WARPSYNC', 'NANOSLEEP', 'YIELD', 'ELECT', 'VOTE', 'VOTEU'): return 'control/BRA/ELECT/VOTE'
    if o in ('NOP',): return 'NOP'
    if o in ('MOV', 'UMOV', 'IMAD' ) and ('.MOV' in op or o in ('MOV','UMOV')): return 'MOV (incl IMAD.MOV/UMOV)'
    if o in ('R2UR', 'S2R', 'S2UR', 'CS2R', 'S2UR', 'UR2R', 'R2P', 'P2R', 'PLOP3', 'UPLOP3', 'LDC', 'ULDC', 'SEL', 'USEL', 'PRMT', 'UPRMT'): return 'MOV-like (R2UR/S2R/LDC/SEL/PRMT/PLOP3)'
    if o.startswith('U'): return 'uniform int ALU (U*)'
    if o in ('IMAD', 'IADD3', 'LOP3', 'SHF', 'LEA', 'ISETP', 'IMNMX', 'VIMNMX', 'VIADD', 'IABS', 'POPC', 'FLO', 'BREV', 'LOP', 'IADD', 'ISCADD', 'SGXT', 'BMSK', 'IDP', 'VIADDMNMX', 'IMUL', 'LEA.HI'): return 'int ALU (IMAD/IADD3/LOP3/SHF/LEA/ISETP)'
    return 'other:' + o
def parse(path):
    ins, labels, pend = [], {}, []
    for line in open(path):
        m = LAB.match(line)
        if m: pend.append(m.group(1)); continue
        m = INS.search(line)
        if m:
            addr = int(m.group(1), 16); text = m.group(2).strip()
            for l in pend: labels[l] = addr
            pend = []
            t = text
            pred = ''
            if t.startswith('@'):
                pred, t = t.split(None, 1)
            op = t.split()[0]
            ins.append(dict(addr=addr, pred=pred, op=op, text=text))
    return ins, labels
def main():
    path = sys.argv[1]; dump = sys.argv[sys.argv.index('--dump') + 1] if '--dump' in sys.argv else None
    ins, labels = parse(path)
    idx = {x['addr']: i for i, x in enumerate(ins)}
    tot = collections.Counter(classify(x['op'], x['text']) for x in ins)
    print(f"# {os.path.basename(path)}: total SASS instructions {len(ins)} (incl. NOP padding: {tot.get('NOP',0)})")
    loops = []
    for i, x in enumerate(ins):
        if x['op'].startswith('BRA'):
            m = re.search(r'\(\s*(\.L_x_\d+)\s*\)', x['text'])
            if m and m.group(1) in labels and labels[m.group(1)] <= x['addr']:
                loops.append((idx[labels[m.group(1)]], i, m.group(1)))
    for (s, e, lab) in loops:
        body = ins[s:e + 1]
        if any(x['op'] == 'EXIT' and not x['pred'] for x in body):
            continue  # return jump of an out-of-line (cold) block, not a loop of its own
        c = collections.Counter(classify(x['op'], x['text']) for x in body)
        kinds = []
        if c['HGMMA']: kinds.append('MMA consumer loop')
        if any(x['op'].startswith('UTMALDG') for x in body): kinds.append('TMA load (producer)')
        if any(x['op'].startswith('UBLKRED') or x['op'].startswith('UTMAREDG') for x in body): kinds.append('dQ bulk-reduce writer')
        if len(body) <= 6 and c['SYNCS (mbarrier)']: kinds.append('mbarrier spin-wait (cold path)')
        if c['SHFL'] and c['global/local mem'] and not c['HGMMA']: kinds.append('varlen tile-scheduler batch search (warp SHFL scan of cu_seqlens)')
        # fast path: the 'TRYWAIT; @P BRA skip; TRYWAIT; @!P BRA slow' retry pairs are skipped when the 1st try succeeds
        skipped = 0
        for i2, x in enumerate(body):
            if x['op'].startswith('BRA') and x is not body[-1]:
                m2 = re.search(r'\(\s*(\.L_x_\d+)\s*\)', x['text'])
                if m2 and m2.group(1) in labels and body[0]['addr'] <= labels[m2.group(1)] <= body[-1]['addr'] and labels[m2.group(1)] > x['addr']:
                    seg = [y for y in body if x['addr'] < y['addr'] < labels[m2.group(1)]]
                    if seg and seg[0]['op'].startswith('SYNCS.PHASECHK') and len(seg) <= 3:
                        skipped += len(seg)
        if skipped: kinds.append(f'fast path (mbarrier try-wait succeeds first time): {len(body)-skipped} instrs executed')
        print(f"\n## loop {lab}: 0x{ins[s]['addr']:04x}..0x{ins[e]['addr']:04x}  {len(body)} instrs  [{', '.join(kinds) or '?'}]")
        for k, v in sorted(c.items(), key=lambda kv: -kv[1]):
            print(f"   {v:5d}  {k}")
        shapes = collections.Counter(re.sub(r'\s+', ' ', x['op']) for x in body if x['op'].startswith('HGMMA'))
        for k, v in shapes.items(): print(f"   HGMMA shape {k}: {v}")
        rs = sum(1 for x in body if x['op'].startswith('HGMMA') and re.match(r'HGMMA\S*\s+R\d+,\s*R\d+', x['text']))
        if c['HGMMA']:
            print(f"   HGMMA with A from registers (RS): {rs}, A from smem (SS): {c['HGMMA']-rs}")
            ops = collections.Counter(x['op'].split('.')[0] for x in body)
            print("   per opcode: " + "  ".join(f"{k}:{v}" for k, v in ops.most_common()))
        fwd = [(x['addr'], x['text']) for x in body if x['op'].startswith('BRA') and x is not ins[e]]
        for a, t in fwd:
            print(f"   inner branch @0x{a:04x}: {t}")
        bars = [x['text'] for x in body if x['op'].startswith(('BAR', 'SYNCS', 'WARPGROUP', 'UBLK', 'UTMA', 'MEMBAR', 'FENCE', 'DEPBAR'))]
        for t in bars: print(f"      sync/tma: {t}")
        if dump:
            os.makedirs(dump, exist_ok=True)
            with open(os.path.join(dump, f"{os.path.basename(path).split('.')[0]}_loop{lab[5:]}.sass"), 'w') as f:
                for x in body: f.write(f"/*{x['addr']:04x}*/ {x['text']} ;\n")
    print("\n## whole-kernel class totals")
    for k, v in sorted(tot.items(), key=lambda kv: -kv[1]): print(f"   {v:5d}  {k}")
main()

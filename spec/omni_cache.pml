/*
 * omni_cache.pml: the omni-cache write and read protocol as a SPIN model.
 *
 * Normative behaviour: spec/SPEC.md. Rule ids such as STEP-1 or
 * HIT-6 are written STEP_1, HIT_6 here (Promela names cannot hold a dash).
 * Design choices modelled, from spec/DESIGN.md: D1 one JOIN_NEXT_STEP
 * (immediate) write per step; D2 one open JOIN_ON_FINISH (deferred) write
 * per request; D4 hit reads planned at start and re-planned at save, with
 * copy-on-write for pending reads; D5 pages held by the step and by the
 * step's immediate write; D8 committer progress reported by completion
 * records. spec/MODEL.md says what is abstracted and why the bounds suffice.
 *
 * Processes, one per real thread:
 *   Engine    - composes each engine step (finish, abort and preempt
 *               events, starts and resumes with hits, scheduling), calls
 *               new_step_starts, then save_outputs: save barrier, budget
 *               flush, page claim, save.
 *   Builder   - the async output builder: materialize or discard_step of any
 *               unconsumed step, in any order, possibly a step late; a
 *               materialize hands each request the positions it has not
 *               had yet (DLV-2) or is refused (DLV-5).
 *   Committer - the committer thread: copy stage, HOST_READY, pool write,
 *               publish the completion record, wake; it may fail.
 *   Clock     - lets the deadline of a blocked wait pass (FAIL-3).
 * The locked part of each public call is one atomic block (one state lock,
 * CONC-1). Waits are blocking statements in those blocks: there the
 * atomicity is given up until the wait ends, so other threads run exactly
 * where the calling thread could be overtaken.
 *
 * Values: a row is named by the engine step that computed it (1..MAXSTEP),
 * 0 stands for zeros. A read that returns 2 returned the rows step 2
 * computed; the oracle compares that with the engine's own ground truth.
 * A position of a request is recomputed after a resume under another step
 * number; its value (what a full recompute gives, DLV-6) is named apart,
 * by admission and position (see "Ground truth of delivery").
 *
 * Safety: CHECK(RULE, condition) is assert(RULE || condition) with RULE a
 * constant 0, so pan's message names the rule. Liveness: the ltl blocks at
 * the end (pan -a -f -N name). Known-bad variants: spin -DBUG_<NAME>.
 * Trace: every action prints one line "ACT <name> k=v ... [-> outcome]",
 * documented in spec/MODEL.md under "Trace vocabulary".
 */

/* ---------------------------------------------------------------- bounds */

/* Three engine steps are enough for every interleaving of interest: reuse of
 * a block needs the write (step 1), a hit planned on it (step 1 or 2) and the
 * new tenant's claim (step 2 or 3); a page recycled under a reader needs two
 * unconsumed steps plus a third save waiting for a page. */
#ifndef MAXSTEP
#define MAXSTEP 3
#endif
#if MAXSTEP > 4
#error "MAXSTEP above 4: task ids would reach the owner codes and the escalation mask"
#endif
#define NREQ 2          /* two request ids; an id may be re-admitted (HIT-2) */
#define NBLK 2          /* two KV blocks ... */
#define BS 2            /* ... of two slots: a block can be half written */
#define NSLOT 4
#define NPAGE 2         /* two pages: one step may lag while the next saves */
#define MAXT (3 * MAXSTEP + 1) /* write task ids: one immediate and at most two
                                   * deferred writes opened per step */
/* GPU clone budget in clone units: a step charges one unit for its
 * immediate clone and one for its deferred clone. Three units let a deferred
 * write stay open across steps (appends, D2) and still force a flush
 * (BUDGET-2) when three steps keep deferred clones alive. */
#ifndef BUDGET
#define BUDGET 3
#endif
#ifndef STARTS
#define STARTS 3        /* request admissions per run: two tenants + a reuse */
#endif
/* One fault per run, of any kind: a wait running past its bound, a
 * committer failure, or a hit on a block the cache never saw (which only the
 * first step can offer). Two faults in one run add nothing: the first one
 * already ends the run's useful life (an error, a sticky failure). */
#ifndef FAULTS
#define FAULTS 1
#endif
#ifndef TIMEOUTS
#define TIMEOUTS 1      /* 0 disables deadline faults */
#endif
#ifndef FAILURES
#define FAILURES 1      /* 0 disables committer failures */
#endif
#ifndef DIVERGED
#define DIVERGED 1      /* 0 disables diverged hits */
#endif
/* Preemptions per run (LIFE-3): a running request loses its blocks and may
 * come back RESUMED (LIFE-4) in that step or a later one, with a hit of 0 or
 * one block; the delivery cursor (DLV-2) then sits below, at or above the
 * resume's hit_end depending on how far the builder got. One preemption
 * already gives every such case within three steps; 0 switches them off. */
#ifndef PREEMPTS
#define PREEMPTS 1
#endif

/* ------------------------------------------------------------ encodings */

/* Task states (TASK-2). */
#define T_NONE 0
#define T_PENDING 1
#define T_QUEUED 2
#define T_COPYING 3
#define T_HOST_READY 4
#define T_WRITTEN 5
#define T_FAILED 6

/* Slot owner (D3): 0 COMMITTED, 1..MAXT-1 the in-flight write, else: */
#define O_COMMITTED 0
#define O_ABSENT 14
#define O_UNKNOWN 15
#define IS_TID(o) ((o) > 0 && (o) < MAXT)

/* Hit read sources (D4). */
#define R_NONE 0
#define R_POOL 1        /* COMMITTED: the pool, or the preserved copy */
#define R_AFTER 2       /* in transit, immediate: wait WRITTEN, then the pool */
#define R_TASK 3        /* in transit, deferred: the write task's own rows */
#define R_ZEROS 4       /* UNKNOWN or ABSENT mm key */
#define R_THIS 5        /* written by this very step (HIT-5) */
#define R_HIT4 6        /* hidden key UNKNOWN or ABSENT: must raise */

/* Read errors. */
#define E_OK 0
#define E_HIT4 1
#define E_HIT6 2
#define E_FAILED 3

#define EXP_ERR 255     /* the oracle expects an error (HIT-4) */

/* Step states (STEP-1). */
#define S_UNSAVED 0
#define S_OPEN 1
#define S_TAKEN 2       /* the builder popped it and is reading */
#define S_CONSUMED 3

#define SK(s, k) ((s) * 2 + (k))
#define NRE (MAXSTEP * 4)
#define RE(K, k, j) (((((K) - 1) * 2) + (k)) * 2 + (j))
#ifndef SPEC_DRAFTS
#define NRA NRE
#define RE_STEP(e) ((e) / 4 + 1)
#define RE_KEY(e) (((e) / 2) % 2)
#define RE_SLOT(e) (s_hblk[RE_STEP(e)] * 2 + (e) % 2)
/* The request a read is for, and the position it delivers. */
#define RE_REQ(e, K) (s_hreq[K] - 1)
#define RE_POS(e, K) ((e) % 2)
#else
/* SPEC-4: after the hit reads, two catch-up reads per step (one slot, both
 * keys): the accepted draft rows of a step consumed before its acceptance was
 * learned, read back from their slot like a hit (one draft row per run). */
#define NRA (NRE + MAXSTEP * 2)
#define CU(K, k) (NRE + ((K) - 1) * 2 + (k))
#define RE_STEP(e) ((e) < NRE -> (e) / 4 + 1 : ((e) - NRE) / 2 + 1)
#define RE_KEY(e) ((e) < NRE -> ((e) / 2) % 2 : ((e) - NRE) % 2)
#define RE_SLOT(e) ((e) < NRE -> s_hblk[RE_STEP(e)] * 2 + (e) % 2 : s_cslot[RE_STEP(e)])
#define RE_REQ(e, K) ((e) < NRE -> s_hreq[K] - 1 : s_creq[K] - 1)
#define RE_POS(e, K) ((e) < NRE -> (e) % 2 : s_cpos[K])
#endif
#define BIT(x) (1 << (x))
#define HAS(m, x) ((((m) >> (x)) & 1) == 1)
#define NBITS(m) (((m) & 1) + (((m) >> 1) & 1) + (((m) >> 2) & 1) + (((m) >> 3) & 1))
#define MAX(x, y) ((x) > (y) -> (x) : (y))
/* Per step and request: index of the step's delivery record. */
#define SR(K, r) ((K) * 2 + (r))

/* Read error names in the trace. */
mtype = { hit4, hit6, failed };

/* How a consume ended (the Builder's err). */
#define W_OK 0
#define W_FATAL 1
#define W_DISCARD 2
#define W_READ 3
#define W_TIMEOUT 4
#define W_ORDER 5       /* DLV-5: refused, nothing changed, the step stays open */

/* Rule names for assertion messages; always 0. */
hidden byte STEP_1, STEP_2, STEP_5, PAGE_2, PAGE_3, SLOT_2, SLOT_3, SLOT_4;
hidden byte TASK_1, TASK_2, TASK_3, TASK_6, BUDGET_1, HIT_4, HIT_5, HIT_6;
hidden byte FAIL_1, FAIL_3, MODEL_BOUND, REACHED;
hidden byte LIFE_1, LIFE_2, LIFE_3, DLV_1, DLV_2, DLV_3, DLV_5, DLV_6;
hidden byte SPEC_1, SPEC_2, SPEC_3, SPEC_4, SPEC_5;
#define CHECK(rule, c) assert(rule || (c))

/* Reachability probes: with -DPROBES every probe is an assertion that
 * fails when its situation is reached, so a run lists which of the
 * situations the bounds can produce (spec/run_checks.sh requires all).
 * With -DPROBE=k only probe k counts, and the run fails at its very end
 * once it went through it: pan's trail is then a whole run showing that
 * situation, which `spin -t` prints as a trace (the trace replay's
 * regression cases are made so). */
#ifdef PROBES
#define REACH(k) assert(REACHED == (k))
#else
#ifdef PROBE
bool g_probe;
#define REACH(k) if :: (k) == PROBE -> g_probe = 1 :: else -> skip fi
#else
#define REACH(k) skip
#endif
#endif

/* ------------------------------------------------------------- state */

/* Engine ground truth: which step last computed each slot's KV (0: never),
 * and whether that computation emitted the sparse key (else 0 = absent). */
byte gt0[NSLOT];
byte gt1[NSLOT];
/* Engine block tables. */
bool e_live[NREQ];                /* admitted and not ended (running or preempted) */
bool e_pre[NREQ];                 /* preempted: live for delivery, no blocks (LIFE-3) */
byte e_adm[NREQ];                 /* its admission, numbered 1..STARTS in start order */
byte preempts_left = PREEMPTS;
bool e_emit[NREQ];                /* the request emits the sparse mm key */
byte e_pos[NREQ];                 /* tokens computed so far (0..4) */
byte e_blk[NREQ * 2];             /* block id + 1 per table index, 0 none */
byte b_fill[NBLK];                /* slots computed by the current tenant */
bool b_cached[NBLK];              /* hash published: hits may use it */
bool b_virgin[NBLK] = 1;          /* never computed at all */
byte starts_left = STARTS;
/* This step's composition (cleared after the save). */
bool c_fin[NREQ];
bool c_pre[NREQ];                 /* a PREEMPTED record */
byte c_res[NREQ];                 /* a RESUMED record: hit_end + 1 */
byte c_new[NREQ];                 /* a STARTED record: hit_end + 1 */
bool c_emit[NREQ];
byte c_mask[NREQ];                /* slots scheduled per request */
byte m_imm;                       /* all slots of the step (hidden key) */
byte m_def;                       /* slots whose request emits the mm key */
byte m_abs;                       /* slots whose request does not emit it */

/* Core: occupancy (D3), pool, requests, sticky failure. */
byte own[NSLOT * 2] = O_UNKNOWN;
byte ver[NSLOT * 2];
byte pool[NSLOT * 2];
byte gclaim[NSLOT * 2];           /* ghost: newest claimant (O_ABSENT: absence) */
bool fatal;                       /* FAIL-1 sticky failure */
byte r_def[NREQ];                 /* open JOIN_ON_FINISH task per request (D2) */
byte r_jns[NREQ];                 /* latest immediate write holding its rows */
short esc;                        /* deferred writes escalated since last save */

/* Write tasks, indexed by tid. Key 0 is hidden (immediate, JOIN_NEXT_STEP),
 * key 1 the sparse mm key (deferred, JOIN_ON_FINISH); a task has one key. */
byte t_st[MAXT];
bit t_kind[MAXT];                 /* 0 immediate, 1 deferred: also its key */
byte t_mask[MAXT];                /* slots it writes */
byte t_tomb[MAXT];                /* SLOT-2 tombstones: slots it lost */
byte t_val[MAXT * NSLOT];         /* the rows it carries, per slot */
byte t_step[MAXT];                /* immediate: its step */
byte t_page[MAXT];                /* immediate: its page */
byte t_req[MAXT];                 /* deferred: its request */
byte t_views[MAXT];               /* deferred: steps whose clone it views */
bit t_pin[MAXT];                  /* still charged against the budget */
byte t_rec[MAXT];                 /* completion record: 1 written, 2 failed */
bit t_drained[MAXT];              /* the core has drained the record */
bit t_hr[MAXT];                   /* host_ready event set */
bit t_done[MAXT];                 /* done event set (waiters woken) */
bit t_copies[MAXT];               /* copy stages run (at most one) */
bit t_inq[MAXT];
byte q[MAXT];                     /* the committer's high-priority queue */
byte qlen;
byte next_tid = 1;

/* Pages (D5). */
byte pg_step[NPAGE];              /* step holder */
byte pg_task[NPAGE];              /* immediate write holder */
byte pg_val[NPAGE];               /* which step's rows the page holds */

/* Steps and their hit reads (one hit request per step). */
byte s_st[MAXSTEP + 2];
byte s_page[MAXSTEP + 2];
byte s_jns[MAXSTEP + 2];
byte s_hreq[MAXSTEP + 2];         /* request + 1 that hit in this step */
byte s_hblk[MAXSTEP + 2];
byte nopen;
byte r_src[NRA];
byte r_tid[NRA];
byte r_ver[NRA];
byte r_pres[NRA];                 /* preserved row + 1 (copy-on-write) */
byte r_exp[NRA];                  /* ghost: what the read must return */

/* Core: requests and delivery (LIFE, DLV), per admission a = 1..STARTS. */
#define NADM (STARTS + 2)
bool r_pre[NREQ];                 /* the core's view: the request is preempted */
byte a_c[NADM];                   /* next position of its rows (DLV-1) */
byte a_d[NADM];                   /* delivery cursor (DLV-2) */
byte s_adm[(MAXSTEP + 2) * 2];    /* per step and request: the admission it carries */
byte s_lo[(MAXSTEP + 2) * 2];     /* ... and the positions [lo, hi): hit rows, own rows */
byte s_hi[(MAXSTEP + 2) * 2];
byte s_ref;                       /* steps refused (DLV-5) since the last consume ended */

/* Ground truth of delivery. Each position of an admission has a value, the
 * one a full recompute gives: positions are named by admission and position
 * (a * 4 + p), except the positions a STARTED hit covers, which carry the
 * values of the rows the hit found (a_tok). A recompute after a resume gives
 * the same names, so a row computed twice has one value under two step
 * numbers. g_wc is what each step computed in each slot (by value). */
byte g_wc[(MAXSTEP + 1) * NSLOT];
byte a_tok[NADM * 2];             /* values of positions 0, 1 inherited from a hit */
byte g_dl[NADM];                  /* positions delivered (DLV-2), a mask */
byte g_top[NADM];                 /* positions saved so far: [0, g_top) */
byte g_lost[NADM];                /* positions not yet delivered that a discarded or
                                   * failed step carried (DLV-4), a mask */
#define TRUTH(a, p) ((p) < 2 && a_tok[(a) * 2 + (p)] != 0 -> a_tok[(a) * 2 + (p)] : (a) * 4 + (p))
#define CONT(s) (gt0[s] == 0 -> 0 : g_wc[gt0[s] * NSLOT + (s)])

#ifdef SPEC_DRAFTS
/* Speculative decoding (SPEC). A step may carry, for a running request, a
 * trailing draft row: it computes positions [c, c + 2), of which c is
 * confirmed at save and c + 1 is a draft (k = 1). The engine's count c' (c + 1
 * or c + 2) is fixed when the step computes (the sampler) and reaches the core
 * at the next new_step_starts (computed_tokens) or earlier, when a consume
 * reports it (ConsumeBegin.computed). One draft row per run (DRAFTS), at c = 1
 * or c = 2, so the request owns the block of every position it may go on
 * from and is scheduled again in the step that confirms it (the catch-up of
 * SPEC-4 rides on the request's next save). A draft at c = 2 is the last row
 * of the request's table: accepted, the request has nothing left to compute
 * and finishes with the draft unconfirmed, its block full and hashed (SPEC-5).
 * A request with an unconfirmed draft may be preempted (PREEMPTS > 0). */
#ifndef DRAFTS
#define DRAFTS 1
#endif
byte drafts_left = DRAFTS;
/* Engine: the request's unconfirmed draft (its step, 0: none), the draft's
 * position (the step's confirmed end) and slot, and the sampler's count c'. */
byte e_dstep[NREQ];
byte e_dpos[NREQ];
byte e_dslot[NREQ];
byte e_acc[NREQ];
byte c_dk[NREQ];                  /* this step: draft rows scheduled per request */
byte c_conf[NREQ];                /* this step confirms the request's drafts: c' + 1 */
/* Core: the pending drafts per request (as _drafts.Drafts keeps them), the
 * count a consume reported (+ 1), and per step the confirmed end of each
 * request's rows (valid, SPEC-1) and the catch-up read it carries (SPEC-4). */
byte r_dstep[NREQ];
byte r_dpos[NREQ];
byte r_dslot[NREQ];
byte r_rep[NREQ];
byte r_old[NREQ];                 /* an older write of the request that lost a slot (SLOT-5) */
byte s_creq[MAXSTEP + 2];         /* request + 1 with a catch-up read */
byte s_cslot[MAXSTEP + 2];
byte s_cpos[MAXSTEP + 2];
/* Ghosts: per step and request the engine's count c' for its drafts (+ 1,
 * 0: no drafts), and per step the slots whose rows were rejected or dropped
 * unconfirmed (never to be served, SPEC-3). */
byte g_acc[(MAXSTEP + 2) * 2];
byte g_rjs[MAXSTEP + 2];
byte g_acu[MAXSTEP + 2];          /* ... and the accepted draft rows left unconfirmed */
#endif

/* Budget (BUDGET-1): one unit per clone allocation. */
bit tk_imm[MAXSTEP + 2];
byte tk_def[MAXSTEP + 2];         /* tasks still viewing the deferred clone */
byte bused;
byte bpend;                       /* admitted, not yet committed */

/* Fault budgets and ghosts. */
byte faults_left = FAULTS;
byte waiting;                     /* blocked waiters: 1 engine, 2 builder */
byte tmo_fire;                    /* their deadline has passed */
bool g_fail_pub;                  /* a committer failure has been published */
bool eng_done;
bool bld_done;
bool shut;
bool comm_done;

/* Temporaries, only used inside atomic sequences that cannot block. */
hidden byte dt, ds, dk, co, ce, qi, uk, bk, bsum, pe, px, fb, fq, fn, cs1, sv0, sv1, sv2;
hidden byte da, dr, dlo, dhi, dst, den, dp, dsh, og, cres;
hidden byte oq, oe, olo, ohi;     /* a refusal: request, earlier step, gap (DLV-5) */

/* ---------------------------------------------------------- helpers */

/* TASK-2: the only legal moves. */
inline MOVE(tt, to) {
  CHECK(TASK_2,
    (to == T_PENDING && t_st[tt] == T_NONE) ||
    (to == T_QUEUED && t_st[tt] == T_PENDING) ||
    (to == T_COPYING && t_st[tt] == T_QUEUED) ||
    (to == T_HOST_READY && t_st[tt] == T_COPYING) ||
    (to == T_WRITTEN && t_st[tt] == T_HOST_READY) ||
    (to == T_FAILED && t_st[tt] >= T_PENDING && t_st[tt] <= T_HOST_READY));
  t_st[tt] = to
}

/* FAIL-3: every wait is bounded. A wait that is not satisfied at once gives
 * up the atomicity (the thread blocks outside the state lock); the Clock may
 * then let its deadline pass. A wait that nobody can ever satisfy would be a
 * hang, which the timeout branch turns into a violation. */
inline wait_for(who, c) {
  if
  :: c -> skip
  :: else ->
     waiting = waiting | (who);
     if
     :: (c) || (tmo_fire & (who)) != 0 -> skip
     :: timeout -> CHECK(FAIL_3, 0)
     fi;
     waiting = waiting & ~(who)
  fi
}

/* D8 says every public entry drains the completion records before it
 * decides anything. Since no decision is taken between a record being
 * published and the next entry's drain, the model drains right at publish:
 * the states in between differ only in data nobody reads, and the entries'
 * own drain (ENTRY_DRAIN) has nothing left to do. The TASK-6 variant, which
 * wakes before it publishes, still shows a waiter that finds no record. */
#define EAGER_DRAIN drain()
#define ENTRY_DRAIN skip

inline q_push_back(tt) {
  q[qlen] = tt; qlen++; t_inq[tt] = 1
}

inline q_push_front(tt) {
  qi = qlen;
  do
  :: qi > 0 -> q[qi] = q[qi - 1]; qi--
  :: else -> break
  od;
  q[0] = tt; qlen++; t_inq[tt] = 1; qi = 0
}

inline q_remove(tt) {
  qi = 0;
  do
  :: qi < qlen && q[qi] != tt -> qi++
  :: else -> break
  od;
  if
  :: qi < qlen ->
     do
     :: qi + 1 < qlen -> q[qi] = q[qi + 1]; qi++
     :: else -> break
     od;
     qlen--; q[qlen] = 0; t_inq[tt] = 0
  :: else -> skip
  fi;
  qi = 0
}

/* TASK-4: escalation moves a write to the front of the high-priority queue;
 * it never touches a write the committer already took (TASK-2). */
inline escalate(tt) {
  d_step {
  if
#ifndef BUG_LOST_ESCALATION
  :: tt != 0 && t_st[tt] == T_PENDING -> MOVE(tt, T_QUEUED); q_push_front(tt)
#else
  /* Liveness control: a lost wake-up; the write is marked QUEUED but never
   * reaches a queue, so nobody ever runs it. */
  :: tt != 0 && t_st[tt] == T_PENDING -> MOVE(tt, T_QUEUED)
#endif
  :: tt != 0 && t_st[tt] == T_QUEUED && t_inq[tt] -> q_remove(tt); q_push_front(tt)
#ifdef BUG_REQUEUE
  /* Origin double-write race: the committer popped the task but has not yet
   * marked it COPYING, and escalation pushes it back onto the queue. */
  :: tt != 0 && t_st[tt] == T_QUEUED && !t_inq[tt] -> q_push_front(tt)
#endif
  :: else -> skip
  fi
  }
}

/* BUDGET-1: charged once per clone allocation, uncharged once, when the last
 * task viewing it has copied or failed. */
inline budget_inv() {
  d_step {
  bsum = bpend; bk = 1;
  do
  :: bk <= MAXSTEP ->
     bsum = bsum + tk_imm[bk] + (tk_def[bk] > 0 -> 1 : 0); bk++
  :: else -> break
  od;
  CHECK(BUDGET_1, bsum == bused);
  bsum = 0; bk = 0
  }
}

inline uncharge(tt) {
  d_step {
  if
  :: t_kind[tt] == 0 ->
     CHECK(BUDGET_1, tk_imm[t_step[tt]] == 1 && bused > 0);
     tk_imm[t_step[tt]] = 0; bused--
  :: else ->
     uk = 1;
     do
     :: uk <= MAXSTEP ->
        if
        :: HAS(t_views[tt], uk) ->
           CHECK(BUDGET_1, tk_def[uk] > 0);
           tk_def[uk]--;
           if
           :: tk_def[uk] == 0 -> CHECK(BUDGET_1, bused > 0); bused--
           :: else -> skip
           fi
        :: else -> skip
        fi;
        uk++
     :: else -> break
     od;
     uk = 0
  fi;
  t_pin[tt] = 0;
  budget_inv()
  }
}

inline release_task_page(tt) {
  if
  :: t_kind[tt] == 0 && pg_task[t_page[tt]] == tt -> pg_task[t_page[tt]] = 0
  :: else -> skip
  fi
}

/* FAIL-1 and TASK-6: a failed write releases its page and budget and
 * publishes its failure record before its waiters are woken. */
inline fail_task(tt) {
  d_step {
  MOVE(tt, T_FAILED);
  if
  :: t_pin[tt] -> uncharge(tt)
  :: else -> skip
  fi;
#ifndef BUG_FAILED_KEEPS_PAGE
  release_task_page(tt);
#else
  /* Liveness control: a failed write keeps its page forever. */
  skip;
#endif
  t_rec[tt] = 2;
  t_hr[tt] = 1; t_done[tt] = 1
  }
}

#ifdef SPEC_DRAFTS
#define OLD_FREE(x) (r_old[0] != (x) && r_old[1] != (x))
#else
#define OLD_FREE(x) 1
#endif

/* D8: the core takes in the published completion records. SLOT-3: only
 * the slots a completed write still owns become COMMITTED; a failure record
 * makes the failure sticky (FAIL-1). */
inline drain() {
  d_step {
  dt = 1;
  do
  :: dt < MAXT ->
     if
     :: t_rec[dt] != 0 && !t_drained[dt] ->
        t_drained[dt] = 1;
        if
        :: t_rec[dt] == 1 ->
           dk = t_kind[dt]; ds = 0;
           do
           :: ds < NSLOT ->
              if
              :: (HAS(t_mask[dt], ds) && own[SK(ds, dk)] == dt) ->
                 CHECK(SLOT_3, pool[SK(ds, dk)] == t_val[dt * NSLOT + ds]);
                 own[SK(ds, dk)] = O_COMMITTED; gclaim[SK(ds, dk)] = 0
              :: else -> skip
              fi;
              ds++
           :: else -> break
           od
        :: else -> fatal = 1
        fi
     :: else -> skip
     fi;
     dt++
  :: else -> break
  od;
  /* Forget what nobody can look at any more: the data of a drained, ended
   * write that no pending read, open request, barrier or slot refers to.
   * Its state, drained flag and wake events stay (waiters, the final checks
   * and the liveness claims read them). States that differ only in dead
   * data are then one state. */
  dt = 1;
  do
  :: dt < MAXT ->
     if
     :: t_drained[dt] && (t_st[dt] == T_WRITTEN || t_st[dt] == T_FAILED) && t_mask[dt] != 0 &&
        r_def[0] != dt && r_def[1] != dt && r_jns[0] != dt && r_jns[1] != dt && OLD_FREE(dt) &&
        !HAS(esc, dt) && s_jns[1] != dt && s_jns[2] != dt && s_jns[3] != dt &&
        s_jns[MAXSTEP] != dt && s_jns[MAXSTEP - 1] != dt ->
        ds = 0;
        do
        :: ds < NRA && !((r_src[ds] == R_AFTER || r_src[ds] == R_TASK) && r_tid[ds] == dt) -> ds++
        :: else -> break
        od;
        dk = 0;
        do
        :: dk < NSLOT * 2 && own[dk] != dt -> dk++
        :: else -> break
        od;
        if
        :: ds == NRA && dk == NSLOT * 2 ->
           t_kind[dt] = 0; t_mask[dt] = 0; t_tomb[dt] = 0; t_step[dt] = 0; t_page[dt] = 0;
           t_req[dt] = 0; t_views[dt] = 0; t_rec[dt] = 0;
           t_copies[dt] = 0;
           t_val[dt * NSLOT] = 0; t_val[dt * NSLOT + 1] = 0;
           t_val[dt * NSLOT + 2] = 0; t_val[dt * NSLOT + 3] = 0
        :: else -> skip
        fi
     :: else -> skip
     fi;
     dt++
  :: else -> break
  od;
  dt = 0; ds = 0; dk = 0
  }
}

/* HIT-6: before a claim or an explicit absence changes a slot, a pending
 * read of an unconsumed step that planned on the COMMITTED row at the same
 * version gets that row preserved. */
inline cow(cs, ck) {
#ifndef BUG_NO_VERSION
  ce = 0;
  do
  :: ce < NRA ->
     if
     :: (r_src[ce] == R_POOL || r_src[ce] == R_AFTER) && RE_KEY(ce) == ck &&
        RE_SLOT(ce) == cs && own[SK(cs, ck)] == O_COMMITTED &&
        ver[SK(cs, ck)] == r_ver[ce] && r_pres[ce] == 0 ->
        r_pres[ce] = pool[SK(cs, ck)] + 1
     :: else -> skip
     fi;
     ce++
  :: else -> break
  od;
  ce = 0
#else
  skip
#endif
}

/* SLOT-2: a claim bumps the version and displaces (tombstones) the owner. */
inline claim(cs, ck, ct) {
  d_step {
  cow(cs, ck);
  co = own[SK(cs, ck)];
  if
  :: IS_TID(co) ->
     /* TASK-3: an immediate slot is never claimed while an older immediate
      * write of it has not landed in the pool. */
     CHECK(TASK_3, ck == 1 || t_st[co] == T_WRITTEN || t_st[co] == T_FAILED);
     t_tomb[co] = t_tomb[co] | BIT(cs)
  :: else -> skip
  fi;
  own[SK(cs, ck)] = ct; ver[SK(cs, ck)]++; gclaim[SK(cs, ck)] = ct;
  co = 0
  }
}

/* SLOT-4: a request with scheduled tokens that does not emit the sparse key
 * leaves explicit absence in its slots, never the older tenant's rows. */
inline mark_absent(cs) {
  d_step {
#ifndef BUG_ABSENT_NO_COW
  cow(cs, 1);
#endif
  co = own[SK(cs, 1)];
  if
  :: IS_TID(co) -> t_tomb[co] = t_tomb[co] | BIT(cs)
  :: else -> skip
  fi;
  own[SK(cs, 1)] = O_ABSENT; ver[SK(cs, 1)]++; gclaim[SK(cs, 1)] = O_ABSENT;
  co = 0
  }
}

/* D4: one read's source, planned version and tid (HIT-3). */
inline plan_one(pe) {
     px = own[SK(RE_SLOT(pe), RE_KEY(pe))];
     if
     :: px == O_COMMITTED ->
        r_src[pe] = R_POOL; r_ver[pe] = ver[SK(RE_SLOT(pe), RE_KEY(pe))]
     :: IS_TID(px) ->
#ifdef BUG_RESUME_READS_POOL
        /* A resume takes the request's own deferred writes, escalated at its
         * PREEMPTED, for landed: it reads the pool before they are written. */
        if
        :: cres && RE_KEY(pe) == 1 && t_st[px] >= T_QUEUED ->
           r_src[pe] = R_POOL; r_ver[pe] = ver[SK(RE_SLOT(pe), 1)]
        :: else ->
#endif
        r_src[pe] = (RE_KEY(pe) == 0 -> R_AFTER : R_TASK); r_tid[pe] = px;
        r_ver[pe] = ver[SK(RE_SLOT(pe), RE_KEY(pe))]
#ifdef BUG_RESUME_READS_POOL
        fi
#endif
     :: else ->
        r_src[pe] = (RE_KEY(pe) == 0 -> R_HIT4 : R_ZEROS)
     fi
}

/* D4: plan the reads of a request that starts with a hit, at new_step_starts. */
inline plan_reads(K) {
  d_step {
  pe = RE(K, 0, 0);
  do
  :: pe <= RE(K, 1, 1) -> plan_one(pe); pe++
  :: else -> break
  od;
  pe = 0; px = 0
  }
}


/* D4: at save, the reads registered by this step's starts switch to this
 * step's producer (HIT-5) or to zeros where it left absence; the sparse key
 * is dropped when the step did not emit it at all (OUT-6). The ghost
 * expectation is taken from the engine's ground truth now. */
inline replan_reads(K) {
  d_step {
  pe = RE(K, 0, 0);
  do
  :: pe <= RE(K, 1, 1) ->
     px = RE_SLOT(pe);
     if
     :: RE_KEY(pe) == 0 ->
        if
        :: HAS(m_imm, px) -> r_src[pe] = R_THIS; r_pres[pe] = 0
        :: else -> skip
        fi;
        r_exp[pe] = (gt0[px] == 0 -> EXP_ERR : gt0[px])
     :: else ->
        if
        :: m_def == 0 -> r_src[pe] = R_NONE; r_tid[pe] = 0; r_ver[pe] = 0; r_pres[pe] = 0;
           REACH(16)                                 /* OUT-6: key not emitted, read dropped */
        :: m_def != 0 && HAS(m_def, px) -> r_src[pe] = R_THIS; r_pres[pe] = 0
#ifndef BUG_SPARSE_OLD
        :: m_def != 0 && HAS(m_abs, px) -> r_src[pe] = R_ZEROS; r_pres[pe] = 0
#endif
        :: else -> skip
        fi;
        r_exp[pe] = (r_src[pe] == R_NONE -> 0 : gt1[px])
     fi;
     pe++
  :: else -> break
  od;
  pe = 0; px = 0
  }
}

inline dispose_reads(K) {
  d_step {
  pe = RE(K, 0, 0);
  do
  :: pe <= RE(K, 1, 1) ->
     r_src[pe] = R_NONE; r_tid[pe] = 0; r_ver[pe] = 0; r_pres[pe] = 0; r_exp[pe] = 0;
     pe++
  :: else -> break
  od;
#ifdef SPEC_DRAFTS
  pe = CU(K, 0);
  do
  :: pe <= CU(K, 1) ->
     r_src[pe] = R_NONE; r_tid[pe] = 0; r_ver[pe] = 0; r_pres[pe] = 0; r_exp[pe] = 0;
     pe++
  :: else -> break
  od;
  s_creq[K] = 0; s_cslot[K] = 0; s_cpos[K] = 0;
#endif
  pe = 0
  }
}

#ifdef SPEC_DRAFTS
/* SPEC-4: the catch-up reads of step K, planned at new_step_starts like a
 * hit's (from the pool, or the write in flight: HIT-3). */
inline plan_catchup(K) {
  d_step {
  pe = CU(K, 0);
  do
  :: pe <= CU(K, 1) -> plan_one(pe); pe++
  :: else -> break
  od;
  pe = 0; px = 0
  }
}

/* At save: the expectation from the engine's ground truth. Nothing in this
 * step writes the slot (the request goes on from c', above it); the sparse
 * read is dropped when the step emits no sparse key at all (OUT-6). */
inline replan_catchup(K) {
  d_step {
  px = s_cslot[K];
  CHECK(SPEC_4, !HAS(m_imm, px));
  r_exp[CU(K, 0)] = (gt0[px] == 0 -> EXP_ERR : gt0[px]);
  if
  :: m_def == 0 ->
     r_src[CU(K, 1)] = R_NONE; r_tid[CU(K, 1)] = 0; r_ver[CU(K, 1)] = 0; r_pres[CU(K, 1)] = 0
  :: else -> skip
  fi;
  r_exp[CU(K, 1)] = (r_src[CU(K, 1)] == R_NONE -> 0 : gt1[px]);
  px = 0
  }
}

/* SPEC-3: rows that must never be served (rejected drafts, at their
 * confirmation or, with a reported count, at an end, SPEC-5): their slot becomes ABSENT for every key,
 * version bumped (copy-on-write first, as for any change of a slot, HIT-6),
 * and the writes still carrying them are tombstoned, so their rows never
 * reach the pool. */
inline reject_slot(cs) {
  d_step {
  dk = 0;
  do
  :: dk < 2 ->
     cow(cs, dk);
     co = own[SK(cs, dk)];
     if
     :: IS_TID(co) ->
#ifndef BUG_SPEC_REJECTED_HIT
        t_tomb[co] = t_tomb[co] | BIT(cs);
#endif
        skip
     :: else -> skip
     fi;
     own[SK(cs, dk)] = O_ABSENT; ver[SK(cs, dk)]++; gclaim[SK(cs, dk)] = O_ABSENT;
     dk++
  :: else -> break
  od;
  dk = 0; co = 0
  }
}
#endif

/* ------------------------------------------------------- engine helpers */

#define BLK_USED(b) (e_blk[0] == (b) + 1 || e_blk[1] == (b) + 1 || \
                     e_blk[2] == (b) + 1 || e_blk[3] == (b) + 1)
#define NFREE ((BLK_USED(0) -> 0 : 1) + (BLK_USED(1) -> 0 : 1))
/* New blocks needed to schedule n tokens of request r from its position. */
#define NEED(r, n) ((e_pos[r] % 2 == 0 && e_blk[(r) * 2 + e_pos[r] / 2] == 0 -> 1 : 0) + \
                    ((n) == 2 && e_pos[r] % 2 == 1 && e_pos[r] + 1 < 4 && \
                     e_blk[(r) * 2 + (e_pos[r] + 1) / 2] == 0 -> 1 : 0))
#define CAN(r, n) (e_pos[r] + (n) <= 4 && NEED(r, n) <= NFREE)

inline lowest_free(res) {
  res = 0;
  do
  :: res < NBLK && BLK_USED(res) -> res++
  :: else -> break
  od
}

/* Compute n tokens of request r in step K (allocating blocks lowest first). */
inline schedule(K, r, n) {
  d_step {
  fn = 0;
  do
  :: fn < n ->
     if
     :: e_blk[r * 2 + e_pos[r] / 2] == 0 ->
        lowest_free(fb);
        CHECK(MODEL_BOUND, fb < NBLK);
        e_blk[r * 2 + e_pos[r] / 2] = fb + 1;
        b_fill[fb] = 0; b_cached[fb] = 0; b_virgin[fb] = 0
     :: else -> skip
     fi;
     fq = (e_blk[r * 2 + e_pos[r] / 2] - 1) * 2 + e_pos[r] % 2;
     c_mask[r] = c_mask[r] | BIT(fq);
     gt0[fq] = K;
     g_wc[K * NSLOT + fq] = TRUTH(e_adm[r], e_pos[r]);
     b_fill[fq / 2]++;
     if
     :: b_fill[fq / 2] == BS -> b_cached[fq / 2] = 1   /* hash published at allocation */
     :: else -> skip
     fi;
     e_pos[r]++; fn++
  :: else -> break
  od;
  fn = 0; fq = 0; fb = 0
  }
}

inline choose_tokens(K, r, n) {
  /* A request mid-block may compute one token (completing the block) or two;
   * at a block boundary it computes as much as it can. One-token steps give
   * half-written blocks, so a hit can mix two sources. */
  if
  :: e_pos[r] % 2 == 1 && CAN(r, 1) -> n = 1
  :: CAN(r, 2) -> n = 2
  :: e_pos[r] % 2 == 0 && !CAN(r, 2) && CAN(r, 1) -> n = 1
  :: !CAN(r, 1) -> n = 0
  fi;
#ifdef SPEC_DRAFTS
  /* SPEC: a step of two rows from position 1 or 2 may carry the second as a
   * draft (positions [1, 3) or [2, 4)); the request owns the block of every
   * position it may go on from (2 or 3; 3, or none at the table's end). */
  if
  :: n == 2 && (e_pos[r] == 1 || e_pos[r] == 2) && drafts_left > 0 ->
     if
     :: skip
     :: c_dk[r] = 1; drafts_left--
     fi
  :: else -> skip
  fi;
#endif
  choose_new_tokens(K, r, n)
}

inline choose_new_tokens(K, r, n) {
  if
  :: n > 0 ->
     cs1 = e_pos[r];
     schedule(K, r, n);
     /* The save names its emitted keys per step (spec/DESIGN.md D11): a
      * request scheduled after another in the same step follows that
      * request's emission; SLOT-4 still applies to every request of a step
      * that does not emit the key, after a tenant that did. */
     if
     :: c_mask[1 - r] != 0 -> c_emit[r] = c_emit[1 - r]
     :: else -> c_emit[r] = e_emit[r]
     fi;
#ifndef SPEC_DRAFTS
     printf("ACT sched step=%d req=%d pos=%d n=%d blk0=%d blk1=%d key1=%d\n", K, r, cs1, n,
            e_blk[r * 2] - 1, e_blk[r * 2 + 1] - 1, c_emit[r]);
#else
     if
     :: c_dk[r] != 0 ->
        /* The draft row is computed but not hashed yet: the sampler's count
         * c' is fixed now, and the engine hashes the row's block once the
         * output is processed, if the row was accepted (at the next step's
         * start, whatever becomes of the request: SPEC-5). */
        e_dstep[r] = K; e_dpos[r] = e_pos[r] - c_dk[r];
        e_dslot[r] = (e_blk[r * 2 + e_dpos[r] / 2] - 1) * 2 + e_dpos[r] % 2;
        b_fill[e_dslot[r] / 2]--; b_cached[e_dslot[r] / 2] = (b_fill[e_dslot[r] / 2] == BS);
        if
        :: e_acc[r] = e_dpos[r]                   /* the draft is rejected */
        :: e_acc[r] = e_dpos[r] + 1               /* ... or accepted */
        fi
     :: else -> skip
     fi;
     /* draft: the last rows that are drafts (SaveBegin.drafts); computed: the
      * count c' this step's computed_tokens confirms (SPEC-2). */
     if
     :: c_conf[r] != 0 ->
        printf("ACT sched step=%d req=%d pos=%d n=%d blk0=%d blk1=%d key1=%d draft=%d computed=%d\n",
               K, r, cs1, n, e_blk[r * 2] - 1, e_blk[r * 2 + 1] - 1, c_emit[r], c_dk[r], c_conf[r] - 1)
     :: else ->
        printf("ACT sched step=%d req=%d pos=%d n=%d blk0=%d blk1=%d key1=%d draft=%d\n",
               K, r, cs1, n, e_blk[r * 2] - 1, e_blk[r * 2 + 1] - 1, c_emit[r], c_dk[r])
     fi;
#endif
     cs1 = 0
  :: else -> skip
  fi;
  n = 0
}

/* A request that is not live may start: a miss, a hit on a cached block, or
 * (DIVERGED) a hit on a block the cache never saw, which HIT-4 must refuse. */
inline maybe_start(K, r, n, hb) {
  if
  :: !e_live[r] && starts_left > 0 && (r == 0 || e_live[0]) ->
     if
     :: e_live[0] || e_live[1] -> skip   /* an idle engine would just end the run */
     :: NFREE > 0 ->
        hb = 0
     :: s_hreq[K] == 0 && b_cached[0] && NFREE - (BLK_USED(0) -> 0 : 1) > 0 ->
        hb = 1
     :: s_hreq[K] == 0 && b_cached[1] && NFREE - (BLK_USED(1) -> 0 : 1) > 0 ->
        hb = 2
     :: DIVERGED && K == 1 && s_hreq[K] == 0 && faults_left > 0 && b_virgin[0] &&
        !BLK_USED(0) && NFREE > 1 ->
        hb = 1; faults_left--; b_virgin[0] = 0; b_fill[0] = BS; b_cached[0] = 1
     :: DIVERGED && K == 1 && s_hreq[K] == 0 && faults_left > 0 && !(b_virgin[0] && !BLK_USED(0)) &&
        b_virgin[1] && !BLK_USED(1) && NFREE > 1 ->
        hb = 2; faults_left--; b_virgin[1] = 0; b_fill[1] = BS; b_cached[1] = 1
     fi;
     if
     :: hb != 255 ->
        starts_left--; e_live[r] = 1; c_new[r] = (hb == 0 -> 1 : BS + 1);
        e_adm[r] = STARTS - starts_left;
        /* Whether this request emits the sparse mm key (in every step it
         * runs); a tenant that does not emit it after one that did is the
         * SLOT-4 case. The first request of a run emits it: a run that
         * starts without it is a run where the key appears later, which the
         * later admissions already cover. */
        if
        :: e_emit[r] = 1
        :: starts_left < STARTS - 1 -> e_emit[r] = 0
        fi;
        if
        :: hb == 0 ->
           printf("ACT start step=%d req=%d hit=0 blk=-1 key1=%d\n", K, r, e_emit[r])
        :: else ->
           e_blk[r * 2] = hb; e_pos[r] = BS;
           s_hreq[K] = r + 1; s_hblk[K] = hb - 1;
           /* The hit's positions have the values of the rows it found. */
           a_tok[e_adm[r] * 2] = CONT((hb - 1) * 2);
           a_tok[e_adm[r] * 2 + 1] = CONT((hb - 1) * 2 + 1);
           printf("ACT start step=%d req=%d hit=%d blk=%d key1=%d\n", K, r, BS, hb - 1, e_emit[r])
        fi;
        /* A new request computes a whole block. Only the first request of
         * a run may compute a single token: that half-written block, which
         * the request completes in a later step, is what lets one hit mix
         * an earlier step's rows with this step's (HIT-5); more half blocks
         * add combinations of the same situations. */
        if
        :: starts_left == STARTS - 1 && CAN(r, 1) -> n = 1
        :: CAN(r, 2) -> n = 2
        :: !CAN(r, 2) -> n = 1
        fi;
        choose_new_tokens(K, r, n)
     :: else -> skip
     fi;
     hb = 255
  :: else -> skip
  fi
}

/* An admission that has ended and that no unconsumed step carries is gone:
 * every position it saved was delivered exactly once, except those a
 * discarded or failed step carried before they were delivered (DLV-2,
 * DLV-4). Its data is forgotten. */
#define CARRIED(a) (s_adm[SR(1, 0)] == (a) || s_adm[SR(1, 1)] == (a) || \
                    s_adm[SR(2, 0)] == (a) || s_adm[SR(2, 1)] == (a) || \
                    s_adm[SR(3, 0)] == (a) || s_adm[SR(3, 1)] == (a) || \
                    s_adm[SR(4, 0)] == (a) || s_adm[SR(4, 1)] == (a))
inline retire(a) {
  if
  :: a != 0 && e_adm[0] != a && e_adm[1] != a && !CARRIED(a) ->
     CHECK(DLV_2, ((g_dl[a] | g_lost[a]) & (BIT(g_top[a]) - 1)) == BIT(g_top[a]) - 1);
     a_c[a] = 0; a_d[a] = 0; g_dl[a] = 0; g_top[a] = 0; g_lost[a] = 0;
     a_tok[a * 2] = 0; a_tok[a * 2 + 1] = 0
  :: else -> skip
  fi
}

/* The engine's records for a live request, before anything is scheduled
 * (HIT-2, LIFE-2): a running request may finish (or abort), be preempted,
 * or run on; one whose block table is full has nothing left to compute and
 * finishes. A preempted request may finish, or stay preempted and perhaps
 * come back RESUMED below, in this very step or a later one. */
inline end_or_preempt(K, r) {
  if
  :: e_live[r] ->
     if
     :: c_fin[r] = 1
     :: !e_pre[r] && e_pos[r] < 4 -> skip
     :: e_pre[r] -> skip
     :: !e_pre[r] && e_pos[r] < 4 && preempts_left > 0 -> c_pre[r] = 1
     fi
  :: else -> skip
  fi;
  if
  :: c_fin[r] ->
     e_live[r] = 0; e_pre[r] = 0; e_blk[r * 2] = 0; e_blk[r * 2 + 1] = 0; e_pos[r] = 0;
     printf("ACT finish step=%d req=%d\n", K, r);
     /* LIFE-1: the admission ends; its unconsumed steps may still be consumed. */
     dr = e_adm[r]; e_adm[r] = 0; retire(dr); dr = 0
  :: c_pre[r] ->
     /* LIFE-3: the request's KV blocks are gone; it stays live for delivery. */
     preempts_left--; e_pre[r] = 1; e_blk[r * 2] = 0; e_blk[r * 2 + 1] = 0; e_pos[r] = 0;
     printf("ACT preempt step=%d req=%d\n", K, r)
  :: else -> skip
  fi
}

#ifdef SPEC_DRAFTS
/* SPEC-2: the engine's side of the acceptance, at the next step's start. An
 * accepted row is a token: the engine hashes its block now if the block is
 * full, whether the request runs on, finishes or is preempted (SPEC-5), so
 * it may be hit in this very step, by another request or a resume. A request
 * that runs on reports its count c' (computed_tokens), and a rejected row is
 * recomputed from c' in this step (the request owns the block); one that
 * ends or is preempted reports none. A rejected row is never hashed and
 * never to be served (ghost g_rjs); an accepted row left unconfirmed is
 * recorded (ghost g_acu) for the probe of a hit over it. */
inline engine_confirm(K, r) {
  if
  :: e_dstep[r] != 0 && (c_fin[r] || c_pre[r] || !e_live[r]) ->
     if
     :: e_acc[r] > e_dpos[r] ->
        b_fill[e_dslot[r] / 2]++;
        b_cached[e_dslot[r] / 2] = (b_fill[e_dslot[r] / 2] == BS);
        g_acu[e_dstep[r]] = g_acu[e_dstep[r]] | BIT(e_dslot[r])
     :: else ->
        g_rjs[e_dstep[r]] = g_rjs[e_dstep[r]] | BIT(e_dslot[r]);
        gt0[e_dslot[r]] = 0; gt1[e_dslot[r]] = 0
     fi;
     e_dstep[r] = 0; e_dpos[r] = 0; e_dslot[r] = 0; e_acc[r] = 0
  :: e_dstep[r] != 0 && !c_fin[r] && !c_pre[r] && e_live[r] ->
     c_conf[r] = e_acc[r] + 1;
     if
     :: e_acc[r] > e_dpos[r] ->
        b_fill[e_dslot[r] / 2]++;
        b_cached[e_dslot[r] / 2] = (b_fill[e_dslot[r] / 2] == BS)
     :: else ->
        e_pos[r] = e_acc[r];
        g_rjs[e_dstep[r]] = g_rjs[e_dstep[r]] | BIT(e_dslot[r]);
        gt0[e_dslot[r]] = 0; gt1[e_dslot[r]] = 0
     fi;
     e_dstep[r] = 0; e_dpos[r] = 0; e_dslot[r] = 0; e_acc[r] = 0
  :: else -> skip
  fi
}

/* new_step_starts, the core's side of a confirmation, before the records
 * (SPEC-2): positions [base, c') are accepted, the rest rejected (SPEC-3),
 * and the request's next position rolls back to c'. The step that carries
 * the drafts hands out the accepted rows itself while it is unconsumed
 * (its valid end is raised); once it was consumed with the cursor at base,
 * the request's next save carries them as a catch-up read (SPEC-4); a step
 * discarded or failed before leaves them passed over (DLV-4). */
inline apply_confirm(K, r) {
  if
  :: c_conf[r] != 0 ->
     CHECK(SPEC_2, r_dstep[r] != 0 && c_conf[r] - 1 >= r_dpos[r] && c_conf[r] - 1 <= r_dpos[r] + 1 &&
                   (r_rep[r] == 0 || r_rep[r] == c_conf[r]));
     dp = c_conf[r] - 1;
     da = e_adm[r];
     if
     :: dp == r_dpos[r] -> reject_slot(r_dslot[r]); REACH(37)   /* a draft rejected */
     :: else -> skip
     fi;
     dk = r_dstep[r];
     a_c[da] = dp;
     /* A materialize between its begin and its end would count as consumed
      * here; at these bounds the builder's join never waits for a step the
      * engine has started another step after (MODEL.md). */
     CHECK(MODEL_BOUND, s_st[dk] != S_TAKEN);
     if
     :: s_st[dk] == S_OPEN ->
        CHECK(SPEC_2, s_adm[SR(dk, r)] == da);
        s_hi[SR(dk, r)] = dp;
        if :: dp > r_dpos[r] -> REACH(34) :: else -> skip fi   /* accepted rows of an open step */
     :: s_st[dk] != S_OPEN && dp > r_dpos[r] && a_d[da] == r_dpos[r] ->
#ifndef BUG_SPEC_NO_CATCHUP
        s_creq[K] = r + 1; s_cslot[K] = r_dslot[r]; s_cpos[K] = r_dpos[r];
        plan_catchup(K);
#endif
        REACH(35)                                  /* a catch-up read */
     :: s_st[dk] != S_OPEN && dp > r_dpos[r] && a_d[da] < r_dpos[r] ->
        /* DLV-4: its step was discarded or failed before it was handed out. */
        g_lost[da] = g_lost[da] | (BIT(dp) - BIT(r_dpos[r]))
     :: else ->
        CHECK(SPEC_2, dp == r_dpos[r] || a_d[da] == dp)
     fi;
     g_top[da] = MAX(g_top[da], dp);
     r_dstep[r] = 0; r_dpos[r] = 0; r_dslot[r] = 0; r_rep[r] = 0;
     dp = 0; da = 0; dk = 0
  :: else -> skip
  fi
}

/* SPEC-5: a finish or preemption of a request whose drafts wait for their
 * count (_core.CacheCore._settle_at_end). With a count the drafted step's
 * consume reported, the rows above it are rejected as SPEC-3 says. Without
 * one the core cannot tell accepted rows from rejected ones and leaves them
 * as written: the engine hashes a block only over accepted rows, and a
 * rejected row's slot is written again before any block holding it is. */
inline drop_drafts(r) {
  if
  :: r_dstep[r] != 0 ->
#ifndef BUG_SPEC_END_MARKS_ACCEPTED_ABSENT
     if
     :: r_rep[r] != 0 && r_rep[r] - 1 == r_dpos[r] ->
        reject_slot(r_dslot[r]); REACH(39)           /* a reported count rejects at the end */
     :: r_rep[r] == 0 -> REACH(42)                  /* no count: the rows stay as written */
     :: else -> skip
     fi;
#else
     /* The first design: every unconfirmed draft becomes ABSENT at the end, so
      * a correct hit over an accepted one raises (HIT-4). */
     reject_slot(r_dslot[r]);
#endif
     r_dstep[r] = 0; r_dpos[r] = 0; r_dslot[r] = 0; r_rep[r] = 0
  :: else -> skip
  fi
}
#endif

/* LIFE-4: a preempted request may come back with a fresh block list and a
 * hit of 0 or of one cached block whose rows are its own first positions
 * (the engine's prefix hash: same tokens, same values). Its positions restart
 * at hit_end. DLV-3: the core opens the hit from the delivery cursor's block
 * on, so only when hit_end is above the cursor; the cursor is wherever the
 * builder got, below, at or above hit_end. */
#define RESUMES_ON(r, b) (b_cached[b] && CONT((b) * 2) == TRUTH(e_adm[r], 0) && \
                          CONT((b) * 2 + 1) == TRUTH(e_adm[r], 1))
inline maybe_resume(K, r, n, hb) {
  if
  :: e_pre[r] ->
     if
     :: skip                                 /* stays preempted */
     :: NFREE > 0 -> hb = 0
     :: s_hreq[K] == 0 && RESUMES_ON(r, 0) && NFREE - (BLK_USED(0) -> 0 : 1) > 0 -> hb = 1
     :: s_hreq[K] == 0 && RESUMES_ON(r, 1) && NFREE - (BLK_USED(1) -> 0 : 1) > 0 -> hb = 2
     fi;
     if
     :: hb != 255 ->
        e_pre[r] = 0;
        dr = e_adm[r];
#ifdef BUG_RESUME_REDELIVERS
        /* The resume restarts the delivery cursor as a STARTED would. */
        a_d[dr] = 0;
#endif
        if
        :: hb == 0 ->
           e_pos[r] = 0; c_res[r] = 1;
           printf("ACT resume step=%d req=%d hit=0 blk=-1\n", K, r)
        :: else ->
           e_blk[r * 2] = hb; e_pos[r] = BS; c_res[r] = BS + 1;
           if
           :: a_d[dr] < BS -> s_hreq[K] = r + 1; s_hblk[K] = hb - 1
           :: else -> skip
           fi;
           printf("ACT resume step=%d req=%d hit=%d blk=%d\n", K, r, BS, hb - 1)
        fi;
        dr = 0;
        /* Like a new request, it computes a whole block where it can. */
        n = (CAN(r, 2) -> 2 : 1);
        choose_new_tokens(K, r, n)
     :: else -> skip
     fi;
     hb = 255
  :: else -> skip
  fi
}

/* new_step_starts, the core's side of a finish or a preemption: the
 * request's open writes are escalated (TASK-4, LIFE-3). */
inline apply_end(r) {
  if
  :: c_fin[r] || c_pre[r] ->
     /* LIFE-2: PREEMPTED only of a running request. */
     CHECK(LIFE_2, c_fin[r] || !r_pre[r]);
     if
     :: r_def[r] != 0 && t_st[r_def[r]] < T_WRITTEN -> esc = esc | BIT(r_def[r])
     :: else -> skip
     fi;
     escalate(r_def[r]); escalate(r_jns[r]);
#ifdef SPEC_DRAFTS
     if
     :: c_pre[r] && r_dstep[r] != 0 -> REACH(44)    /* a preemption with an unconfirmed draft */
     :: else -> skip
     fi;
     drop_drafts(r);
     /* SLOT-5: the older write the request left after a rollback goes too. */
     if
     :: r_old[r] != 0 && t_st[r_old[r]] < T_WRITTEN -> esc = esc | BIT(r_old[r])
     :: else -> skip
     fi;
     escalate(r_old[r]); r_old[r] = 0;
#endif
     /* LIFE-3: nothing computed is lost: the open deferred write is on its way. */
     CHECK(LIFE_3, r_def[r] == 0 || t_st[r_def[r]] != T_PENDING);
     r_def[r] = 0; r_jns[r] = 0;
     r_pre[r] = c_pre[r]
  :: else -> skip
  fi
}

/* new_step_starts, the core's side of a STARTED or RESUMED record. */
inline apply_start(K, r) {
  if
  :: c_new[r] != 0 ->
     /* LIFE-1: a new admission has fresh delivery state. */
     CHECK(LIFE_1, a_c[e_adm[r]] == 0 && a_d[e_adm[r]] == 0 && g_dl[e_adm[r]] == 0);
     a_c[e_adm[r]] = c_new[r] - 1
  :: c_res[r] != 0 ->
     /* LIFE-2: RESUMED only of a preempted request. LIFE-4: its positions
      * restart at hit_end. DLV-3: a hit exactly when hit_end is above the
      * cursor. */
     CHECK(LIFE_2, r_pre[r]);
     r_pre[r] = 0;
     a_c[e_adm[r]] = c_res[r] - 1;
     CHECK(DLV_3, (s_hreq[K] == r + 1) == (c_res[r] - 1 > a_d[e_adm[r]]));
     if
     :: c_res[r] - 1 > a_d[e_adm[r]] -> REACH(24)                    /* hit_end above the cursor */
     :: c_res[r] - 1 == a_d[e_adm[r]] && a_d[e_adm[r]] > 0 -> REACH(25)   /* ... at it */
     :: c_res[r] - 1 < a_d[e_adm[r]] && c_res[r] > 1 -> REACH(26)     /* ... below it */
     :: c_res[r] == 1 && a_d[e_adm[r]] > 0 -> REACH(27)               /* 0, positions delivered */
     :: else -> skip
     fi
  :: else -> skip
  fi
}

/* ------------------------------------------------------------- engine */

proctype Engine() {
  byte K = 1;
  byte n;
  byte hb = 255;
  byte ft;
  byte charge;
  byte p;
  byte ph = 255;     /* PAGE-7: the page the save will claim, 255: none known */
  bool serr;
  bool idle;

  /* One engine step is one atomic block: the locked parts of the public
   * calls never interleave anyway (one state lock), and the unlocked waits
   * (save barrier, budget flush, page claim) are blocking statements inside
   * it, where the atomicity is given up until the wait ends. So the other
   * threads run exactly where the engine thread could be overtaken. */
  do
  :: K > MAXSTEP -> break
  :: K <= MAXSTEP ->
     atomic {
       /* Compose the step: finish, abort and preempt events first (HIT-2,
        * LIFE-2), then running requests are scheduled (their completed
        * blocks become hittable in this very step), then preempted requests
        * resume and new requests start. */
       end_or_preempt(K, 0);
       end_or_preempt(K, 1);
#ifdef SPEC_DRAFTS
       engine_confirm(K, 0);
       engine_confirm(K, 1);
#endif
       if
       :: e_live[0] && !e_pre[0] -> choose_tokens(K, 0, n)
       :: else -> skip
       fi;
       if
       :: e_live[1] && !e_pre[1] -> choose_tokens(K, 1, n)
       :: else -> skip
       fi;
       maybe_resume(K, 0, n, hb);
       maybe_start(K, 0, n, hb);
       maybe_resume(K, 1, n, hb);
       maybe_start(K, 1, n, hb);
       m_imm = c_mask[0] | c_mask[1];
       m_def = (c_emit[0] -> c_mask[0] : 0) | (c_emit[1] -> c_mask[1] : 0);
       m_abs = m_imm & ~m_def;
       /* Ground truth of the sparse key for the slots computed now. */
       fn = 0;
       do
       :: fn < NSLOT ->
          if
          :: HAS(m_def, fn) -> gt1[fn] = K
          :: HAS(m_abs, fn) -> gt1[fn] = 0
          :: else -> skip
          fi;
          fn++
       :: else -> break
       od;
       fn = 0;
       /* Nothing to run: the engine winds down (finishes are delivered
        * below). */
       idle = (m_imm == 0);

       /* new_step_starts: drain, escalate finished requests' writes
        * (TASK-4), register hits and plan their reads (D4). */
       if
       :: idle -> skip
       :: else ->
          ENTRY_DRAIN;
          if
          :: fatal ->
             printf("ACT new_step step=%d -> error=fatal\n", K);
             serr = 1
          :: else ->
             CHECK(FAIL_1, !g_fail_pub);
#ifdef SPEC_DRAFTS
             /* SPEC-2: the step's computed counts confirm drafts before its
              * records apply. */
             apply_confirm(K, 0);
             apply_confirm(K, 1);
#endif
             /* Finishes and preemptions first, then starts and resumes (LIFE-2). */
             apply_end(0);
             apply_end(1);
             apply_start(K, 0);
             apply_start(K, 1);
             if
             :: s_hreq[K] != 0 ->
                cres = c_res[s_hreq[K] - 1]; plan_reads(K); cres = 0
             :: else -> skip
             fi;
             printf("ACT new_step step=%d -> ok\n", K)
          fi;
          c_fin[0] = 0; c_fin[1] = 0
       fi;

       /* save_outputs, 1: the save barrier (TASK-3) waits the previous
        * step's immediate write WRITTEN and the escalated deferred writes
        * HOST_READY; bounded (FAIL-3). */
#define PFREE(x) (pg_step[x] == 0 && pg_task[x] == 0)
       ft = s_jns[K - 1];
#ifdef BUG_BARRIER_HOST_READY
       /* Origin bug: the barrier waited host_ready only, so a reused slot
        * could leave a pending pool write behind. */
#define BAR_JNS (ft == 0 || t_hr[ft])
#else
#define BAR_JNS (ft == 0 || t_done[ft])
#endif
#define ESC_OK ((!HAS(esc, 1) || t_hr[1]) && (!HAS(esc, 2) || t_hr[2]) && \
                (!HAS(esc, 3) || t_hr[3]) && (!HAS(esc, 4) || t_hr[4]) && \
                (!HAS(esc, 5) || t_hr[5]) && (!HAS(esc, 6) || t_hr[6]) && \
                (!HAS(esc, 7) || t_hr[7]) && (!HAS(esc, 8) || t_hr[8]) && \
                (!HAS(esc, 9) || t_hr[9]) && (!HAS(esc, 10) || t_hr[10]) && \
                (!HAS(esc, 11) || t_hr[11]) && (!HAS(esc, 12) || t_hr[12]))
       if
       :: idle || serr -> skip
       :: else ->
          if
          :: !BAR_JNS -> REACH(10)                   /* the barrier waits a write */
          :: BAR_JNS && !ESC_OK -> REACH(20)         /* ... an escalated deferred write */
          :: else -> skip
          fi;
          wait_for(1, BAR_JNS && ESC_OK);
          if
          :: BAR_JNS && ESC_OK ->
             tmo_fire = tmo_fire & ~1;
             ENTRY_DRAIN;
             /* TASK-6: a woken waiter finds the completion record and the
              * page already released. */
             CHECK(TASK_6, ft == 0 || !t_done[ft] ||
                           (t_drained[ft] && pg_task[t_page[ft]] != ft));
             if
             :: fatal ->
                printf("ACT barrier step=%d -> error=fatal\n", K); serr = 1
             :: else ->
                CHECK(FAIL_1, !g_fail_pub);
                /* PAGE-7: the save opens here (the replay's SaveBegin) and
                 * learns the page it will claim: the lowest free one. */
                ph = (PFREE(0) -> 0 : (PFREE(1) -> 1 : 255));
                printf("ACT barrier step=%d -> ok\n", K)
             fi;
             esc = 0; s_jns[K - 1] = 0
          :: else ->
             tmo_fire = tmo_fire & ~1;
             printf("ACT barrier step=%d -> error=timeout\n", K);
             REACH(17);
             serr = 1
          fi
       fi;
       ft = 0;

       /* save_outputs, 2: the budget (BUDGET-2): flush the oldest
        * unfinished write until the step's clones fit; admit anyway when
        * nothing is left to flush. */
       charge = 1 + (m_def != 0 -> 1 : 0);
       do
       :: idle || serr -> break
       :: !idle && !serr ->
          ENTRY_DRAIN;
          if
          :: fatal ->
             printf("ACT budget step=%d -> error=fatal\n", K); serr = 1
          :: else ->
             ft = 1;
             do
             :: ft < MAXT && !(t_st[ft] >= T_PENDING && t_st[ft] <= T_HOST_READY) -> ft++
             :: else -> break
             od;
             if
             :: bused + charge <= BUDGET || ft == MAXT ->
                bused = bused + charge; bpend = charge; ft = 0;
                printf("ACT budget step=%d charge=%d -> used=%d\n", K, charge, bused);
                break
             :: else ->
                escalate(ft);
                if
                :: t_kind[ft] == 1 && r_def[t_req[ft]] == ft -> r_def[t_req[ft]] = 0
                :: else -> skip
                fi;
#ifdef SPEC_DRAFTS
                if
                :: t_kind[ft] == 1 && r_old[t_req[ft]] == ft -> r_old[t_req[ft]] = 0
                :: else -> skip
                fi;
#endif
                printf("ACT flush step=%d tid=%d\n", K, ft);
                REACH(11);
                wait_for(1, t_done[ft]);
                if
                :: t_done[ft] ->
                   tmo_fire = tmo_fire & ~1;
                   ENTRY_DRAIN;
                   CHECK(TASK_6, t_drained[ft]);
                   if
                   :: fatal || t_st[ft] == T_FAILED ->
                      printf("ACT flush_done step=%d tid=%d -> error=failed\n", K, ft); serr = 1
                   :: else ->
                      printf("ACT flush_done step=%d tid=%d -> ok\n", K, ft)
                   fi
                :: else ->
                   tmo_fire = tmo_fire & ~1;
                   printf("ACT flush_done step=%d tid=%d -> error=timeout\n", K, ft);
                   serr = 1
                fi;
                ft = 0
             fi
          fi
       od;

       /* save_outputs, 3: claim a page (PAGE-4: wait, or time out), then
        * the save itself under the lock (D6). */
       if
       :: idle || serr -> skip
       :: else ->
          if
          :: !(PFREE(0) || PFREE(1)) -> REACH(8)     /* a save waits for a page */
          :: else -> skip
          fi;
          wait_for(1, PFREE(0) || PFREE(1))
       fi;
       if
       :: idle || serr -> skip
       :: !idle && !serr && (PFREE(0) || PFREE(1)) ->
          tmo_fire = tmo_fire & ~1;
          /* PAGE-7: the page known at the begin (only a save claims a
           * page, so it is still free: PAGE_3 below), else the lowest. */
          p = (ph != 255 -> ph : (PFREE(0) -> 0 : 1));
          ENTRY_DRAIN;
          if
          :: fatal ->
             /* STEP-5: a failed save leaves no trace. */
             bused = bused - bpend; bpend = 0;
             printf("ACT save step=%d -> error=fatal\n", K); serr = 1
          :: else ->
             CHECK(FAIL_1, !g_fail_pub);
             CHECK(PAGE_3, pg_step[p] == 0 && pg_task[p] == 0);
             CHECK(STEP_1, s_st[K] == S_UNSAVED);
             pg_step[p] = K; pg_val[p] = K;
             s_st[K] = S_OPEN; s_page[K] = p; nopen++;
             CHECK(PAGE_2, nopen <= NPAGE);
             /* D1: one immediate write for the whole step. */
             ft = next_tid; next_tid++;
             CHECK(MODEL_BOUND, ft < MAXT);
             t_kind[ft] = 0; t_step[ft] = K; t_page[ft] = p; t_mask[ft] = m_imm;
             fn = 0;
             do
             :: fn < NSLOT ->
                if
                :: HAS(m_imm, fn) -> claim(fn, 0, ft); t_val[ft * NSLOT + fn] = K
                :: else -> skip
                fi;
                fn++
             :: else -> break
             od;
             pg_task[p] = ft;
             MOVE(ft, T_PENDING); MOVE(ft, T_QUEUED); q_push_back(ft);
             t_pin[ft] = 1; tk_imm[K] = 1; s_jns[K] = ft;
             if :: c_mask[0] != 0 -> r_jns[0] = ft :: else -> skip fi;
             if :: c_mask[1] != 0 -> r_jns[1] = ft :: else -> skip fi;
             sv0 = ft;
             /* D2: the request's open deferred write, or a new one. */
             n = 0;
             do
             :: n < NREQ ->
                if
                :: c_mask[n] != 0 && c_emit[n] ->
                   ft = r_def[n];
#ifdef SPEC_DRAFTS
                   /* SLOT-5: the open write lost a slot this step writes again
                    * (a rejected draft, SPEC-3): a new write is opened; the old
                    * one is escalated when the request ends. */
                   if
                   :: ft != 0 && (t_tomb[ft] & c_mask[n]) != 0 ->
                      CHECK(MODEL_BOUND, r_old[n] == 0);
                      r_old[n] = ft; ft = 0; r_def[n] = 0; REACH(38)
                   :: else -> skip
                   fi;
#endif
                   if
                   :: ft == 0 ->
                      ft = next_tid; next_tid++;
                      CHECK(MODEL_BOUND, ft < MAXT);
                      t_kind[ft] = 1; t_req[ft] = n; MOVE(ft, T_PENDING);
                      r_def[n] = ft
                   :: else ->
                      /* TASK-1: appends only while the write has not started. */
                      CHECK(TASK_1, t_st[ft] == T_PENDING);
                      REACH(15)                      /* a later step appends */
                   fi;
                   fn = 0;
                   do
                   :: fn < NSLOT ->
                      if
                      :: HAS(c_mask[n], fn) -> claim(fn, 1, ft); t_val[ft * NSLOT + fn] = K
                      :: else -> skip
                      fi;
                      fn++
                   :: else -> break
                   od;
                   t_mask[ft] = t_mask[ft] | c_mask[n];
                   t_views[ft] = t_views[ft] | BIT(K); t_pin[ft] = 1; tk_def[K]++;
                   if :: n == 0 -> sv1 = ft :: else -> sv2 = ft fi
                :: c_mask[n] != 0 && !c_emit[n] ->
#ifndef BUG_SPARSE_OLD
                   fn = 0;
                   do
                   :: fn < NSLOT ->
                      if
                      :: HAS(c_mask[n], fn) -> mark_absent(fn)
                      :: else -> skip
                      fi;
                      fn++
                   :: else -> break
                   od;
#endif
                   skip
                :: else -> skip
                fi;
                n++
             :: else -> break
             od;
             n = 0; fn = 0; ft = 0;
             bpend = 0;
             budget_inv();
             /* DLV-1: each request's rows are the positions from its count on;
              * a request that registered a hit here carries the hit's rows
              * first. The count is the core's, kept from the records alone:
              * it must be the position the engine computed from (LIFE-4). */
             do
             :: n < NREQ ->
                if
                :: c_mask[n] != 0 ->
                   CHECK(LIFE_3, !r_pre[n]);         /* D9: no preempted request saves */
                   dr = e_adm[n];
                   CHECK(DLV_1, a_c[dr] + NBITS(c_mask[n]) == e_pos[n]);
                   s_adm[SR(K, n)] = dr;
                   s_lo[SR(K, n)] = (s_hreq[K] == n + 1 -> 0 : a_c[dr]);
                   a_c[dr] = a_c[dr] + NBITS(c_mask[n]);
                   s_hi[SR(K, n)] = a_c[dr];
#ifndef SPEC_DRAFTS
                   g_top[dr] = MAX(g_top[dr], a_c[dr]);
#else
                   /* SPEC-2: a request waiting for its confirmation is never saved. */
                   CHECK(SPEC_2, r_dstep[n] == 0);
                   if
                   :: c_dk[n] != 0 ->
                      /* SPEC-1: the step hands out its confirmed rows only. */
#ifndef BUG_SPEC_DELIVERS_REJECTED
                      s_hi[SR(K, n)] = a_c[dr] - c_dk[n];
#endif
                      r_dstep[n] = K; r_dpos[n] = a_c[dr] - c_dk[n]; r_dslot[n] = e_dslot[n];
                      r_rep[n] = 0;
                      g_acc[SR(K, n)] = e_acc[n] + 1
                   :: else -> skip
                   fi;
                   /* SPEC-4: the catch-up rows come first. */
                   if
                   :: s_creq[K] == n + 1 -> s_lo[SR(K, n)] = s_cpos[K]
                   :: else -> skip
                   fi;
                   g_top[dr] = MAX(g_top[dr], a_c[dr] - c_dk[n]);
#endif
                   dr = 0
                :: else -> skip
                fi;
                n++
             :: else -> break
             od;
             n = 0;
             if
             :: s_hreq[K] != 0 -> replan_reads(K)
             :: else -> skip
             fi;
#ifdef SPEC_DRAFTS
             if
             :: s_creq[K] != 0 -> replan_catchup(K)
             :: else -> skip
             fi;
#endif
             /* d0/d1: the deferred write each request's rows went to (0: none). */
             printf("ACT save step=%d page=%d tid=%d d0=%d d1=%d -> ok\n", K, p, sv0, sv1, sv2);
             sv0 = 0; sv1 = 0; sv2 = 0
          fi
       :: !idle && !serr && !(PFREE(0) || PFREE(1)) ->
          tmo_fire = tmo_fire & ~1;
          bused = bused - bpend; bpend = 0;
          printf("ACT claim_timeout step=%d\n", K);
          REACH(9);
          serr = 1
       fi;
       p = 0; ph = 255; charge = 0;

       if
       :: serr ->
          /* STEP-5: no step id, no page, no budget survives the failed
           * save; the engine stops stepping and winds its requests down. */
          CHECK(STEP_5, s_st[K] == S_UNSAVED && bpend == 0 &&
                        pg_step[0] != K && pg_step[1] != K);
#ifdef SPEC_DRAFTS
          /* DLV-4: the catch-up rows go with the failed save that carried them. */
          if
          :: s_creq[K] != 0 ->
             da = e_adm[s_creq[K] - 1]; g_lost[da] = g_lost[da] | BIT(s_cpos[K]); da = 0
          :: else -> skip
          fi;
#endif
          dispose_reads(K)
       :: else -> skip
       fi;
       c_new[0] = 0; c_new[1] = 0; c_emit[0] = 0; c_emit[1] = 0;
       c_res[0] = 0; c_res[1] = 0;
#ifdef SPEC_DRAFTS
       /* The confirming request is scheduled in the step that confirms it. */
       CHECK(MODEL_BOUND, (c_conf[0] == 0 || c_mask[0] != 0 || serr) &&
                          (c_conf[1] == 0 || c_mask[1] != 0 || serr));
       c_conf[0] = 0; c_conf[1] = 0; c_dk[0] = 0; c_dk[1] = 0;
#endif
       if
       :: !idle -> c_pre[0] = 0; c_pre[1] = 0
       :: else -> skip
       fi;
       c_mask[0] = 0; c_mask[1] = 0; m_imm = 0; m_def = 0; m_abs = 0;
       if
       :: !idle -> K++
       :: else -> skip
       fi
     };
     if
     :: serr || idle -> break
     :: else -> skip
     fi
  od;

  /* Wind down: finish every live request (TASK-4 escalates their writes).
   * Requests finished by a step that had nothing left to run are delivered
   * here too. */
  atomic {
    if
    :: e_live[0] || e_live[1] || c_fin[0] || c_fin[1] ->
       ENTRY_DRAIN;
       if
       :: e_live[0] -> printf("ACT finish step=%d req=0\n", K)
       :: else -> skip
       fi;
       if
       :: e_live[1] -> printf("ACT finish step=%d req=1\n", K)
       :: else -> skip
       fi;
       if
       :: fatal ->
          printf("ACT new_step step=%d -> error=fatal\n", K)
       :: else ->
          CHECK(FAIL_1, !g_fail_pub);
          escalate(r_def[0]); escalate(r_jns[0]);
          escalate(r_def[1]); escalate(r_jns[1]);
#ifdef SPEC_DRAFTS
          /* SPEC-5 at the last finish; SLOT-5's older writes go too. */
          drop_drafts(0); drop_drafts(1);
          escalate(r_old[0]); escalate(r_old[1]);
#endif
          printf("ACT new_step step=%d -> ok\n", K)
       fi
    :: else -> skip
    fi;
    r_def[0] = 0; r_jns[0] = 0; r_def[1] = 0; r_jns[1] = 0;
    e_live[0] = 0; e_live[1] = 0; e_emit[0] = 0; e_emit[1] = 0;
#ifdef SPEC_DRAFTS
    r_old[0] = 0; r_old[1] = 0;
    engine_confirm(K, 0); engine_confirm(K, 1);
#endif
    e_pre[0] = 0; e_pre[1] = 0; r_pre[0] = 0; r_pre[1] = 0;
    c_fin[0] = 0; c_fin[1] = 0; c_pre[0] = 0; c_pre[1] = 0;
    e_blk[0] = 0; e_blk[1] = 0; e_blk[2] = 0; e_blk[3] = 0; e_pos[0] = 0; e_pos[1] = 0;
    dr = e_adm[0]; e_adm[0] = 0; retire(dr);
    dr = e_adm[1]; e_adm[1] = 0; retire(dr); dr = 0;
    eng_done = 1
  };
  bld_done;
  /* FAIL-4: shutdown abandons the writes the committer has not taken; they
   * end FAILED, their waiters are woken and their pages released. */
  atomic {
    shut = 1;
    n = 0;
    ft = 1;
    do
    :: ft < MAXT ->
       if
       :: t_st[ft] == T_PENDING || (t_st[ft] == T_QUEUED && t_inq[ft]) ->
          q_remove(ft); fail_task(ft); n++; REACH(19)
       :: else -> skip
       fi;
       ft++
    :: else -> break
    od;
    EAGER_DRAIN;
    printf("ACT shutdown -> abandoned=%d\n", n);
    ft = 0; n = 0
  }
}

/* ------------------------------------------------------------ builder */

/* One hit read, under the lock: returns the value in px or an error in pe. */
inline read_one(e, K) {
  d_step {
  if
  :: r_src[e] == R_POOL || r_src[e] == R_AFTER ->
     if
     :: r_src[e] == R_AFTER && t_st[r_tid[e]] == T_FAILED -> px = 0; pe = E_FAILED
     :: else ->
        px = pool[SK(RE_SLOT(e), RE_KEY(e))];
        if
        :: r_pres[e] != 0 -> px = r_pres[e] - 1; REACH(1)   /* served from a preserved row */
        :: else -> skip
        fi;
        if
        :: r_src[e] == R_AFTER -> REACH(3)                  /* read after its write landed */
        :: else -> skip
        fi;
#ifdef BUG_NO_VERSION
        /* Origin bug: no versions, so no copy-on-write either; the only check
         * was that the slot is not in transit under another write. */
        pe = (IS_TID(own[SK(RE_SLOT(e), RE_KEY(e))]) &&
              own[SK(RE_SLOT(e), RE_KEY(e))] != r_tid[e] -> E_HIT6 : E_OK)
#else
        pe = (r_pres[e] == 0 && ver[SK(RE_SLOT(e), RE_KEY(e))] != r_ver[e] -> E_HIT6 : E_OK)
#endif
     fi
  :: r_src[e] == R_TASK ->
     if
     :: t_st[r_tid[e]] == T_FAILED -> px = 0; pe = E_FAILED
     :: else -> px = t_val[r_tid[e] * NSLOT + RE_SLOT(e)]; pe = E_OK; REACH(2);  /* a deferred write's own rows */
        if
        :: e < NRE && t_st[r_tid[e]] < T_WRITTEN &&
           g_wc[px * NSLOT + RE_SLOT(e)] == s_adm[SR(K, s_hreq[K] - 1)] * 4 + e % 2 ->
           REACH(30)               /* ... which its own admission computed: a resume's hit */
        :: else -> skip
        fi
     fi
  :: r_src[e] == R_ZEROS ->
     px = 0; pe = E_OK;
     if
     :: pool[SK(RE_SLOT(e), 1)] != 0 -> REACH(6)   /* zeros over an older tenant's row */
     :: else -> skip
     fi
  :: r_src[e] == R_THIS ->
     px = (RE_KEY(e) == 0 -> pg_val[s_page[K]] : K); pe = E_OK;
     if
     :: RE_KEY(e) == 1 -> REACH(21)                  /* a same-step deferred producer */
     :: else -> skip
     fi
  :: r_src[e] == R_HIT4 -> px = 0; pe = E_HIT4
  :: else -> px = 0; pe = E_OK
  fi
  }
}

/* The oracle: the newest completed write of that slot and key as the engine
 * computed it, zeros for explicit absence, or an error where SPEC demands. */
inline check_read(e, K) {
  d_step {
  if
  :: pe != E_OK ->
     printf("ACT read_error step=%d req=%d key=%d slot=%d reason=%e\n", K,
            RE_REQ(e, K), RE_KEY(e), RE_SLOT(e),
            (pe == E_HIT4 -> hit4 : (pe == E_HIT6 -> hit6 : failed)));
     CHECK(HIT_4, pe != E_HIT4 || r_exp[e] == EXP_ERR);
     if
     :: pe == E_HIT4 -> REACH(5)                     /* a hidden hit the cache never saw */
     :: else -> skip
     fi;
     CHECK(HIT_6, pe != E_HIT6);
     CHECK(FAIL_1, pe != E_FAILED || g_fail_pub)
  :: else ->
#ifdef SPEC_DRAFTS
     if
     :: e >= NRE ->
        printf("ACT read step=%d req=%d key=%d slot=%d catchup=1 -> val=%d\n", K,
               RE_REQ(e, K), RE_KEY(e), RE_SLOT(e), px);
        REACH(36)                                    /* a catch-up row read back */
     :: else ->
#endif
     printf("ACT read step=%d req=%d key=%d slot=%d -> val=%d\n", K,
            RE_REQ(e, K), RE_KEY(e), RE_SLOT(e), px);
#ifdef SPEC_DRAFTS
        /* SPEC-3: a hit on a block that held a rejected row, recomputed. */
        if
        :: px != 0 && g_rjs[px - 1] != 0 && HAS(g_rjs[px - 1], RE_SLOT(e)) -> REACH(41)
        :: else -> skip
        fi;
        /* SPEC-5: a hit over an accepted draft no count confirmed. */
        if
        :: px != 0 && HAS(g_acu[px], RE_SLOT(e)) -> REACH(43)
        :: else -> skip
        fi
     fi;
     /* SPEC-1, SPEC-3: a rejected or unconfirmed row is never served. */
     CHECK(SPEC_3, px == 0 || !HAS(g_rjs[px], RE_SLOT(e)));
#endif
     CHECK(HIT_4, r_exp[e] != EXP_ERR);
     CHECK(SLOT_4, RE_KEY(e) == 0 || r_exp[e] != 0 || px == 0);
     CHECK(HIT_5, r_src[e] != R_THIS || px == r_exp[e]);
     CHECK(HIT_6, px == r_exp[e]);
     /* DLV-6: the row is what a full recompute gives at its position (the
      * hit covers positions 0 and 1): the row its step computed in that
      * slot has the admission's value there. Zeros are a value only for
      * the sparse key (absence, SLOT-4). */
     CHECK(DLV_6, (RE_KEY(e) == 1 && px == 0) ||
                  g_wc[px * NSLOT + RE_SLOT(e)] == TRUTH(s_adm[SR(K, RE_REQ(e, K))], RE_POS(e, K)))
  fi
  }
}

/* End of a consume: release the step's page (PAGE-3), dispose its reads,
 * count it consumed exactly once (STEP-1). Right after the first consume of
 * step 1, a second consume of the same id is tried once (STEP-2). */
inline end_consume(K, e, err) {
  CHECK(STEP_1, s_st[K] == S_TAKEN);
  s_st[K] = S_CONSUMED; nopen--;
  /* DLV-4: a discard or a failed consume delivers nothing and moves no
   * cursor; the positions it carried that were not delivered yet may be
   * passed over later. The step's delivery records go, and with them
   * perhaps the last trace of an ended admission. */
  dr = 0;
  do
  :: dr < NREQ ->
     da = s_adm[SR(K, dr)];
     if
     :: da != 0 ->
        if
        :: err != W_OK && s_hi[SR(K, dr)] > a_d[da] ->
           g_lost[da] = g_lost[da] | (BIT(s_hi[SR(K, dr)]) - BIT(MAX(s_lo[SR(K, dr)], a_d[da])))
        :: else -> skip
        fi;
        s_adm[SR(K, dr)] = 0; s_lo[SR(K, dr)] = 0; s_hi[SR(K, dr)] = 0;
#ifdef SPEC_DRAFTS
        g_acc[SR(K, dr)] = 0;
#endif
        retire(da)
     :: else -> skip
     fi;
     dr++
  :: else -> break
  od;
  dr = 0; da = 0;
  s_ref = 0;
  if
  :: pg_step[s_page[K]] == K -> pg_step[s_page[K]] = 0
  :: else -> skip
  fi;
  dispose_reads(K);
  if
  :: err == W_OK || err == W_DISCARD -> printf("ACT consumed step=%d -> ok\n", K)
  :: err == W_FATAL -> printf("ACT consumed step=%d -> error=fatal\n", K)
  :: err == W_READ -> printf("ACT consumed step=%d -> error=read\n", K)
  :: err == W_TIMEOUT -> printf("ACT consumed step=%d -> error=timeout\n", K)
  fi;
  if
  :: K == 1 ->
     e = nopen; err = pg_step[0] + pg_step[1] * 16;
     ENTRY_DRAIN;
     printf("ACT consume_again step=1 -> error=unmatch\n");
     CHECK(STEP_2, s_st[1] == S_CONSUMED && nopen == e &&
                   pg_step[0] + pg_step[1] * 16 == err)
  :: else -> skip
  fi;
  K = 0; e = 0; err = 0
}

/* DLV-5: a request owes rows to step k while k is unconsumed and carries
 * positions of it not yet delivered. A materialize of step K is refused when,
 * for a request whose cursor it would move (hand it rows, or pass over
 * positions, DLV-4: hi > d), an earlier step of the same admission still
 * owes it rows. The error names the first earlier step (by id) and in it the
 * first such request, and the positions it owes: [max(lo, d), hi). */
#define OWES(k, r, a) (s_st[k] == S_OPEN && s_adm[SR(k, r)] == (a) && \
                       s_hi[SR(k, r)] > MAX(s_lo[SR(k, r)], a_d[a]))
inline order_gap(K) {
  d_step {
  og = 0; dp = 1;
  do
  :: dp < K && og == 0 ->
     dr = 0;
     do
     :: dr < NREQ && og == 0 ->
        da = s_adm[SR(K, dr)];
        if
        :: da != 0 && s_hi[SR(K, dr)] > a_d[da] && OWES(dp, dr, da) ->
           og = 1; oq = dr; oe = dp;
           olo = MAX(s_lo[SR(dp, dr)], a_d[da]); ohi = s_hi[SR(dp, dr)];
           /* A rule that refused only steps whose range starts above the
            * cursor would let this one through: it starts at or below it,
            * which only a resume gives (a later step recomputing positions an
            * earlier one still owes). */
           if
           :: s_lo[SR(K, dr)] <= a_d[da] -> og = 2
           :: else -> skip
           fi
        :: else -> skip
        fi;
        dr++
     :: else -> break
     od;
     dp++
  :: else -> break
  od;
  dr = 0; da = 0; dp = 0
  }
}

/* DLV-2: the materialize of step K hands each of its requests the positions
 * [max(lo, d), hi) and moves the cursor d to hi. The ghost checks each
 * position is handed out once per admission and in order, and that nothing
 * below the cursor is left out but what a discarded or failed step carried
 * (DLV-4). DLV-5: no cursor moves while an earlier step of the admission
 * still owes the request rows, and the only positions passed over are those
 * a discarded or failed step carried. DLV-7: the positions are printed for
 * the consumer. */
inline deliver(K) {
  d_step {
  dr = 0;
  do
  :: dr < NREQ ->
     da = s_adm[SR(K, dr)];
     if
     :: da != 0 ->
        dlo = s_lo[SR(K, dr)]; dhi = s_hi[SR(K, dr)];
        dst = MAX(dlo, a_d[da]); den = MAX(dhi, dst);
        dp = 1;
        do
        :: dp < K ->
           CHECK(DLV_5, dhi <= a_d[da] || !OWES(dp, dr, da));
           dp++
        :: else -> break
        od;
        CHECK(DLV_5, ((BIT(dst) - BIT(a_d[da])) & ~g_lost[da]) == 0);
        if
        :: dst > a_d[da] -> REACH(29)              /* positions passed over after a discard */
        :: else -> skip
        fi;
        if
        :: dst > dlo -> REACH(28)                  /* rows below the cursor not handed out again */
        :: else -> skip
        fi;
        if
        :: e_pre[dr] && e_adm[dr] == da -> REACH(31)   /* delivery to a preempted request */
        :: e_adm[dr] != 0 && e_adm[dr] != da -> REACH(32)   /* to an ended admission, id re-admitted */
        :: else -> skip
        fi;
        dp = dst;
        do
        :: dp < den -> CHECK(DLV_2, (g_dl[da] >> dp) == 0); g_dl[da] = g_dl[da] | BIT(dp); dp++
        :: else -> break
        od;
#ifdef SPEC_DRAFTS
        /* SPEC-1: no row at or above the engine's count c' (a rejected row)
         * is handed out by the step that computed it. */
        CHECK(SPEC_1, g_acc[SR(K, dr)] == 0 || den <= g_acc[SR(K, dr)] - 1);
#endif
        a_d[da] = MAX(a_d[da], dhi);
        CHECK(DLV_2, ((g_dl[da] | g_lost[da]) & (BIT(a_d[da]) - 1)) == BIT(a_d[da]) - 1);
        printf("ACT deliver step=%d req=%d start=%d end=%d\n", K, dr, dst, den)
     :: else -> skip
     fi;
     dr++
  :: else -> break
  od;
  dr = 0; da = 0; dlo = 0; dhi = 0; dst = 0; den = 0; dp = 0
  }
}

#ifdef SPEC_DRAFTS
/* SPEC-2: a consume may report the computed count c' of a request whose
 * drafts this step carries (ConsumeBegin.computed: the sampler ran before the
 * consumer); the step then hands out the accepted rows itself, and the slots
 * roll back at the next start. A consume that does not report it hands out
 * the confirmed rows only. */
inline report_drafts(K) {
  if
  :: r_dstep[0] == K -> dr = 0
  :: r_dstep[1] == K -> dr = 1
  :: else -> dr = 2
  fi;
  if
  :: dr < 2 && r_rep[dr] == 0 ->
     if
     :: printf("ACT materialize step=%d -> ok\n", K)
     :: r_rep[dr] = g_acc[SR(K, dr)];
        da = s_adm[SR(K, dr)];
        CHECK(SPEC_2, g_acc[SR(K, dr)] != 0 && da != 0);
        s_hi[SR(K, dr)] = r_rep[dr] - 1;
        g_top[da] = MAX(g_top[da], r_rep[dr] - 1);
        REACH(40);                                   /* a consume reports the count */
        printf("ACT materialize step=%d req=%d computed=%d -> ok\n", K, dr, r_rep[dr] - 1);
        da = 0
     fi
  :: else -> printf("ACT materialize step=%d -> ok\n", K)
  fi;
  dr = 0
}
#endif

/* HIT-3: an in-transit immediate row is read from the pool once its write
 * is WRITTEN; one bounded join covers all of them (FAIL-3). */
#define AFTER_OK(x) (r_src[x] != R_AFTER || t_done[r_tid[x]])
#ifndef SPEC_DRAFTS
#define JOIN_OK (AFTER_OK(RE(K, 0, 0)) && AFTER_OK(RE(K, 0, 1)))
#else
#define JOIN_OK (AFTER_OK(RE(K, 0, 0)) && AFTER_OK(RE(K, 0, 1)) && AFTER_OK(CU(K, 0)))
#endif
#define PICK(k) (s_st[k] == S_OPEN && !HAS(s_ref, k))
/* A discard is offered for every step when requests can be preempted (it
 * then decides which positions are delivered, DLV-4), else for steps with a
 * hit, where it differs from a materialize. */
#define DISCARDABLE(k) (PREEMPTS > 0 || s_hreq[k] != 0)

proctype Builder() {
  byte K;
  byte e;
  byte err;

  do
  :: atomic {
       /* Begin: pop the step context of any unconsumed step (STEP-1: by id,
        * not by age), except one refused since the last consume ended
        * (DLV-5: trying it again could only be refused again). */
       (PICK(1) || PICK(2) || PICK(3)
#if MAXSTEP > 3
        || PICK(4)
#endif
       ) ->
       if
       :: PICK(1) -> K = 1
       :: PICK(2) -> K = 2
       :: PICK(3) -> K = 3
#if MAXSTEP > 3
       :: PICK(4) -> K = 4
#endif
       fi;
       ENTRY_DRAIN;
       if
       :: fatal ->
          /* FAIL-1: the call raises; the step still counts as consumed. */
          s_st[K] = S_TAKEN;
          printf("ACT materialize step=%d -> error=fatal\n", K);
          REACH(18);
          err = W_FATAL
       :: else ->
          CHECK(FAIL_1, !g_fail_pub);
          /* discard_step drops only the read side and delivers nothing
           * (DLV-4); it is offered where it differs from a materialize. */
          if
          :: skip ->
             order_gap(K);
#ifdef BUG_ORDER_PASS_OVER
             /* The materialize ignores the earlier steps still open. */
             og = 0;
#endif
             if
             :: og != 0 ->
                /* DLV-5: refused; nothing changes and the step stays open. */
                err = W_ORDER;
                printf("ACT materialize step=%d req=%d earlier=%d start=%d end=%d -> error=order\n",
                       K, oq, oe, olo, ohi);
                CHECK(DLV_5, s_st[K] == S_OPEN && pg_step[s_page[K]] == K);
                s_ref = s_ref | BIT(K);
                REACH(23);
                if
                :: og == 2 -> REACH(33)   /* a step after a resume waits for an older one */
                :: else -> skip
                fi;
                og = 0; oq = 0; oe = 0; olo = 0; ohi = 0
             :: else ->
                s_st[K] = S_TAKEN;
#ifndef SPEC_DRAFTS
                printf("ACT materialize step=%d -> ok\n", K)
#else
                report_drafts(K)
#endif
             fi
          :: DISCARDABLE(K) ->
             s_st[K] = S_TAKEN;
             printf("ACT discard step=%d -> ok\n", K); err = W_DISCARD
          fi
       fi;
       if
       :: err == W_ORDER -> K = 0; err = W_OK
       :: else -> skip
       fi;
#ifdef BUG_PAGE_EARLY
       /* The page goes back before the builder copied the step's own rows
        * out of it, so a concurrent save can overwrite them (DEV-2). */
       if
       :: K != 0 -> pg_step[s_page[K]] = 0
       :: else -> skip
       fi;
#endif
       if
       :: err != W_OK -> end_consume(K, e, err)
       :: else -> skip
       fi
#ifdef BUG_PAGE_EARLY
     };
     atomic {
#else
       /* Between the begin and the end of a materialize nobody can observe
        * anything in this protocol (the held page protects the step's rows;
        * the reads stay pending for copy-on-write until they are read), so
        * both run as one step unless the join has to wait. The page variant
        * needs that window and keeps it. */
       ;
#endif
       if
       :: K == 0 -> skip
       :: else ->
          wait_for(2, JOIN_OK);
          if
          :: JOIN_OK ->
             tmo_fire = tmo_fire & ~2;
             ENTRY_DRAIN;
             /* TASK-6: a woken joiner finds the completion record. */
             CHECK(TASK_6, r_src[RE(K, 0, 0)] != R_AFTER || t_drained[r_tid[RE(K, 0, 0)]]);
             CHECK(TASK_6, r_src[RE(K, 0, 1)] != R_AFTER || t_drained[r_tid[RE(K, 0, 1)]]);
             if
             :: fatal -> printf("ACT join step=%d -> error=fatal\n", K); err = W_FATAL
             :: else ->
                /* The reads, in a fixed order; the first error raises. Only
                 * the hit rows from the delivery start on are read (DLV-2):
                 * the hit covers positions 0 and 1, the rows of its block. */
                dsh = (s_hreq[K] == 0 -> 0 :
                       MAX(s_lo[SR(K, s_hreq[K] - 1)], a_d[s_adm[SR(K, s_hreq[K] - 1)]]));
                e = RE(K, 0, 0);
                do
                :: e <= RE(K, 1, 1) ->
                   if
                   :: r_src[e] != R_NONE && e % 2 >= dsh ->
                      read_one(e, K);
                      check_read(e, K);
                      if
                      :: pe != E_OK -> err = W_READ; break
                      :: else -> skip
                      fi
                   :: else -> skip
                   fi;
                   e++
                :: else -> break
                od;
#ifdef SPEC_DRAFTS
                /* SPEC-4: then the catch-up rows, unless already handed out. */
                e = CU(K, 0);
                do
                :: err == W_OK && e <= CU(K, 1) ->
                   if
                   :: r_src[e] != R_NONE && s_creq[K] != 0 &&
                      s_cpos[K] >= a_d[s_adm[SR(K, s_creq[K] - 1)]] ->
                      read_one(e, K);
                      check_read(e, K);
                      if
                      :: pe != E_OK -> err = W_READ; break
                      :: else -> skip
                      fi
                   :: else -> skip
                   fi;
                   e++
                :: else -> break
                od;
#endif
                pe = 0; px = 0; dsh = 0;
                if
                :: err == W_OK -> deliver(K)
                :: else -> skip
                fi;
                if
                :: err == W_OK && s_hreq[K] != 0 &&
                   (r_src[RE(K, 0, 0)] == R_THIS) != (r_src[RE(K, 0, 1)] == R_THIS) ->
                   REACH(4)                          /* one hit, two sources */
                :: else -> skip
                fi;
                if
                :: err == W_OK ->
                   /* PAGE-3, DEV-2: the step's own rows are still in its page. */
                   printf("ACT own step=%d page=%d -> val=%d\n", K, s_page[K], pg_val[s_page[K]]);
                   CHECK(PAGE_3, pg_val[s_page[K]] == K)
                :: else -> skip
                fi
             fi
          :: else ->
             tmo_fire = tmo_fire & ~2;
             printf("ACT join step=%d -> error=timeout\n", K);
             err = W_TIMEOUT
          fi;
          end_consume(K, e, err)
       fi
     }
  :: atomic {
       eng_done && nopen == 0 ->
       /* STEP-1: every issued id was consumed exactly once. */
       CHECK(STEP_1, s_st[1] != S_OPEN && s_st[2] != S_OPEN && s_st[3] != S_OPEN &&
                     s_st[MAXSTEP] != S_OPEN);
       /* DLV-2: every admission ended and was checked complete. */
       CHECK(DLV_2, g_top[1] == 0 && g_top[2] == 0 && g_top[STARTS] == 0 && a_d[1] == 0 &&
                    a_d[2] == 0 && a_d[STARTS] == 0);
       bld_done = 1
     };
     break
  od
}

/* ---------------------------------------------------------- committer */

/* The pool-write stage of a write that is HOST_READY: the rows it still
 * owns go to the pool, then (TASK-6) the page is released, the completion
 * record published, and only then are waiters woken. */
inline write_stage(t) {
  if
  :: skip ->
     ds = 0;
     do
     :: ds < NSLOT ->
        if
        :: (HAS(t_mask[t], ds)
#ifndef BUG_IGNORE_TOMBSTONE
            && !HAS(t_tomb[t], ds)
#endif
           ) ->
           /* SLOT-2: the newest tenant always wins. */
           CHECK(SLOT_2, gclaim[SK(ds, t_kind[t])] == t);
           if
           :: t_kind[t] == 0 ->
              /* PAGE-3: the page is still held while it is read. */
              CHECK(PAGE_3, pg_task[t_page[t]] == t);
              pool[SK(ds, 0)] = pg_val[t_page[t]]
           :: else ->
              pool[SK(ds, 1)] = t_val[t * NSLOT + ds]
           fi
        :: HAS(t_mask[t], ds) && HAS(t_tomb[t], ds) -> REACH(7)   /* a tombstone skips a row */
        :: else -> skip
        fi;
        ds++
     :: else -> break
     od;
     ds = 0;
#ifdef BUG_WAKE_EARLY
     /* Origin bug: done was set before the completion record was appended,
      * so a woken joiner drained nothing; the record follows later. */
     MOVE(t, T_WRITTEN); t_done[t] = 1; pubt = t;
#else
     release_task_page(t); t_rec[t] = 1; EAGER_DRAIN;
     MOVE(t, T_WRITTEN); t_done[t] = 1;
#endif
     printf("ACT pool_write tid=%d -> ok\n", t)
  :: FAILURES && faults_left > 0 ->
     faults_left--; g_fail_pub = 1;
     fail_task(t); EAGER_DRAIN;
     if :: t_kind[t] == 1 -> REACH(22) :: else -> skip fi;   /* a deferred pool write fails */
     printf("ACT pool_write tid=%d -> error=write\n", t)
  fi
}

proctype Committer() {
  byte t;
  byte pubt;

end_idle:
  do
  :: atomic {
       qlen > 0 && pubt == 0 ->
       t = q[0];
       q_remove(t);
#ifdef BUG_REQUEUE
       printf("ACT pop tid=%d\n", t)
     };
     atomic {
#endif
       /* TASK-2: the copy stage is claimed in the same step as the pop, so
        * escalation can never re-queue it. */
       MOVE(t, T_COPYING);
       CHECK(TASK_2, t_copies[t] == 0);
       t_copies[t] = 1;
       if
       :: MOVE(t, T_HOST_READY);
          uncharge(t);
          t_hr[t] = 1;
          printf("ACT copy tid=%d -> ok\n", t)
       :: FAILURES && faults_left > 0 ->
          faults_left--; g_fail_pub = 1;
          fail_task(t); EAGER_DRAIN;
          if :: t_kind[t] == 0 -> REACH(13) :: else -> REACH(14) fi;
          printf("ACT copy tid=%d -> error=copy\n", t)
       fi;
#ifndef BUG_BARRIER_HOST_READY
       /* Nobody observes an immediate write between HOST_READY and WRITTEN
        * in this protocol (the save barrier and every reader wait WRITTEN),
        * so its pool write follows in the same step; the barrier variant
        * needs that window and keeps it. */
       if
       :: t_st[t] == T_HOST_READY && t_kind[t] == 0 -> write_stage(t)
       :: else -> skip
       fi;
#endif
       skip
     };
     if
     :: t_st[t] == T_HOST_READY -> atomic { write_stage(t) }
     :: else -> skip
     fi;
     t = 0
  :: atomic {
       pubt != 0 ->
       release_task_page(pubt); t_rec[pubt] = 1; EAGER_DRAIN;
       printf("ACT publish tid=%d\n", pubt);
       pubt = 0
     }
  :: atomic {
       shut && qlen == 0 && pubt == 0 ->
       /* End of run: every page free, every write ended, budget empty. */
       CHECK(PAGE_3, PFREE(0) && PFREE(1));
       CHECK(BUDGET_1, bused == 0);
#ifdef PROBE
       assert(!g_probe);
#endif
       comm_done = 1;
       t = 1;
       do
       :: t < MAXT ->
          CHECK(TASK_2, t_st[t] == T_NONE || t_st[t] == T_WRITTEN || t_st[t] == T_FAILED);
          t++
       :: else -> break
       od;
       t = 0
     };
     break
  od
}

/* The deadlines: while a thread is blocked in a wait, its bound may pass
 * (one fault per run); the waiter then raises a typed error. */
proctype Clock() {
end_clock:
  do
  :: comm_done -> break   /* the last process to end, so a run ends cleanly */
  :: atomic { TIMEOUTS && faults_left > 0 && HAS(waiting, 0) && !HAS(tmo_fire, 0) ->
              faults_left--; tmo_fire = tmo_fire | 1 }
  :: atomic { TIMEOUTS && faults_left > 0 && HAS(waiting, 1) && !HAS(tmo_fire, 1) ->
              faults_left--; tmo_fire = tmo_fire | 2 }
  od
}

init {
  atomic {
    run Engine();
    run Builder();
    run Committer();
    run Clock()
  }
}

/* ------------------------------------------------------------ liveness */

#define HELD(x) (pg_step[x] != 0 || pg_task[x] != 0)
#define ENDED(x) (t_st[x] == T_WRITTEN || t_st[x] == T_FAILED)
#define STARTED(x) (t_st[x] != T_NONE)

/* Every claimed page is eventually free again (its step consumed, its write
 * landed or failed). */
ltl pages_released {
  [] (HELD(0) -> <> !HELD(0)) && [] (HELD(1) -> <> !HELD(1))
}

/* Every registered write eventually ends WRITTEN or FAILED (task ids 1..9,
 * all there are with MAXSTEP 3). */
ltl writes_end {
  [] (STARTED(1) -> <> ENDED(1)) && [] (STARTED(2) -> <> ENDED(2)) &&
  [] (STARTED(3) -> <> ENDED(3)) && [] (STARTED(4) -> <> ENDED(4)) &&
  [] (STARTED(5) -> <> ENDED(5)) && [] (STARTED(6) -> <> ENDED(6)) &&
  [] (STARTED(7) -> <> ENDED(7)) && [] (STARTED(8) -> <> ENDED(8)) &&
  [] (STARTED(9) -> <> ENDED(9))
}
